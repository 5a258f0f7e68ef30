"""RL: rollout, reward, GRPO math, batching, the trainer loop.

Keep this package's import cheap and side-effect free: the reward workers (`python -m
kimi_pipeline.rl.reward --worker`) import it on every (re)start.
"""
