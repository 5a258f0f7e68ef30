"""RL: rollout, GRPO math, batching, the trainer loop (rewards: kimi_pipeline.reward)."""
