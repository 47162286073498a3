"""One module per architecture family: its `ArchSpec`s (`SPECS`) with everything the family needs beyond the
shared pieces of spec.py: its transformers config reading, GGUF tensor names and metadata hooks, checkpoint renames.
llmserve.model.registry builds the architecture table from them (docs/contributing.md: a new architecture)."""
