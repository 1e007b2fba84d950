"""The stages of tools/train_draft.py (run that script; these modules are its parts)."""
