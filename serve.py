"""OpenAI-compatible server: ``python serve.py --model DIR --tp N`` (``--help`` for all flags)."""

import sys

from kk_jax.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
