"""One exception type for every user-facing failure.

The CLI catches `MoectlError`, prints its message and exits with code 2, so bad input never
shows a traceback. Raise it (with a message that says what to do) wherever input is wrong.
"""


class MoectlError(Exception):
    """A clear, user-facing error: bad path, wrong artifact, unsupported model, ..."""
