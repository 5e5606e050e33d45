"""`python -m moectl ...`: the same command line as the installed `moectl` script (`moectl.cli:run`)."""

from moectl.cli import run

if __name__ == "__main__":
    run()
