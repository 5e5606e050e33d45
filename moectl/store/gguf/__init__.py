"""Run users' GGUF files in place (issue 30, foundation): see docs/gguf.md."""
