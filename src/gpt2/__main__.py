"""`python -m gpt2 ...` (and `torchrun -m gpt2 train ...`) runs the CLI."""
import sys

from gpt2.cli import main

sys.exit(main())
