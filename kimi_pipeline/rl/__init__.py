"""RL post-training on Ray (GRPO). Entry: `loop.run_training`, the train stage's driver. It wires the
`rollout_manager.RolloutManager` actor (the engines of `engine_group`, the `prompts`, one `rollout` with reward and
dynamic `sampling`), the `trainer_group.TrainerGroup` of `policy.PolicyWorker` ranks (`grpo` loss, `batching`,
`metrics`) and the `evaluator.PeriodicEval`; `handoff` moves the GPUs of a colocated run, `health` stops a failing
run, `ray_errors` turns failures into the stage's errors. `actor_layout` places every actor, for the run and for
`kimi rehearse` (`rehearse`). Rewards: `kimi_pipeline.reward`."""
