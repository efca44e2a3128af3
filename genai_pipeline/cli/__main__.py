"""`python -m genai_pipeline.cli`: the `genai` command."""

import sys

from genai_pipeline.cli import main

sys.exit(main())
