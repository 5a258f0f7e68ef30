"""``python -m kimi_pipeline.reward --worker``: one symbolic-comparison worker of the pool (pool.py)."""

from kimi_pipeline.reward.pool import main

if __name__ == "__main__":
    main()
