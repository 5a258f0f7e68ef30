"""A thinking model's `</think>` survives decoding: the shipped tiny tokenizer marks it special, and a decode
with `skip_special_tokens=True` deleted it, so every thinking response graded 0 (issue 14, item 5)."""

from __future__ import annotations

from pathlib import Path

from kimi_pipeline.engine.rollout_engine import Completion
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.reward import AnswerGrader, decode_responses
from kimi_pipeline.rl.prompts import Prompt
from kimi_pipeline.rl.rollout import generate_groups

TINY = Path(__file__).resolve().parents[2] / "data" / "tiny" / "model"


class _Engine:
    """The engine boundary: returns fixed token ids (what a thinking policy sampled) for every request."""

    def __init__(self, output_ids: list[int]):
        self.output_ids = output_ids

    def generate(self, prompts, n=1, params=None, return_routed_experts=False):
        return [Completion(list(p), list(self.output_ids), [0.0] * len(self.output_ids), "stop")
                for p in prompts for _ in range(n)]


def _thinking_response(tok) -> list[int]:
    think_open, think_close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert {think_open, think_close} <= set(tok.all_special_ids) | {
        i for i, t in tok.added_tokens_decoder.items() if t.special}, "the tiny tokenizer marks </think> special"
    return ([think_open] + tok.encode("maybe 3", add_special_tokens=False) + [think_close]
            + tok.encode("so \\boxed{7}", add_special_tokens=False) + [tok.eos_token_id])


def test_decode_keeps_think_markers_and_drops_end_of_turn_tokens():
    tok = load_tokenizer(TINY)
    ids = _thinking_response(tok)
    assert "</think>" not in tok.decode(ids, skip_special_tokens=True)  # the old decode: the bug
    (text,) = decode_responses(tok, [ids])
    assert "<think>" in text and "</think>" in text
    assert tok.eos_token not in text and text.rstrip().endswith("\\boxed{7}")


def test_rollout_grades_a_thinking_response_through_the_real_decode_path():
    tok = load_tokenizer(TINY)
    recipe = load_recipe("tiny", ["rollout.thinking=true", "rollout.n_samples_per_prompt=2"])
    prompts = [Prompt(ids=tok.encode("1+6=?", add_special_tokens=False), label="7", text="1+6=?")]
    with AnswerGrader(recipe.rollout.rm_type, thinking=True) as reward:
        (group,) = generate_groups(_Engine(_thinking_response(tok)), tok, reward, prompts, recipe.rollout, seed=0)
    assert [s.reward for s in group] == [1.0, 1.0]
    assert all("</think>" in s.response_text for s in group)
