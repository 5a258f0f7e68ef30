"""Prefect flows: wiring only (the stages live in kimi_pipeline, their task adapters in tasks/)."""
