"""`python -m moectl ...`: the same command line as the installed `moectl` script."""

from moectl.cli import main

if __name__ == "__main__":
    main()
