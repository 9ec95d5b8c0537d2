import os
import sys
from pathlib import Path

# tests import their helpers (synthetic.py) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
# no test may reach a model hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
