"""Weight sync: how the trainer's weights reach the rollout engines every step.

Entry: `updaters.choose_weight_sync(trainer, router)` (called once per set of engines by `rl.policy.PolicyWorker`),
then `.update(version)` every step. `buckets` assembles each bucket of full HF tensors on every trainer rank by
group collectives (the colocated path); the updaters hand the buckets to the engines.
"""
