"""Synthetic models and adapters: seeded random weights in Hugging Face and PEFT format, and the
model shapes benchmarks use. The embedded demo (`app/demo.py`), tests and benchmarks all write
their models here:

  tokenizer.py  the byte-level tokenizer and its chat template
  models.py     model folders: real seeded weights, or config.json alone for dummy weights
  adapters.py   PEFT adapters: one for a model folder, or a fleet sharing a few weight files
  presets.py    LLAMA3_8B and TINY as config.json contents
"""
