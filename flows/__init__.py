"""Prefect flows: wiring only (the stages live in kimi_pipeline, their task adapters in tasks/). Entry: flow `kimi`
(`kimi.kimi`: download → validate → convert → cluster → train → export), which `kimi run` starts and `kimi serve`
serves as deployment `kimi/full` (`serve`). Its parts: `limits` (one run per Ray cluster), `notify` (the failure
hook); `worker` is a Prefect process worker that stops cleanly."""
