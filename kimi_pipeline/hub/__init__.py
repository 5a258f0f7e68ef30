"""Models and datasets into a run: the `download` stage's work (`download.run_download`, from the HF hub or local
directories) and what later stages read of it (`download.model_root`, `dataset_path`, `read_manifest`), every file
recorded and re-verified by sha256 and size (`manifest`)."""
