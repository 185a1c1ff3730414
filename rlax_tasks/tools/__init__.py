"""The user's tools around a run: `rlax export` (a checkpoint as a Hugging Face model),
`rlax doctor` (what this machine can run) and `rlax data` (a dataset's episodes, rendered).
Each is imported only when its command runs; the package imports nothing itself."""
