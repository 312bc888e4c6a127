"""The chapters' demonstrations with torch, one module per topic (needs torch or
numpy at import time)."""
