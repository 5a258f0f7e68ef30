"""pandera schemas for DAPO-Math-17k and AIME-2024 rows.

Rows are first flattened into a frame (one line = one row, parse errors kept as a column), then the
schema's named checks decide each row's fate. Every failing check becomes a quarantine reason, so
the names here are what users read.
"""

from __future__ import annotations

import pandera.pandas as pa

from kimi_pipeline.data.rows import label_value_problem, prompt_problem


def row_schema(name: str, max_prompt_tokens: int) -> pa.DataFrameSchema:
    """Schema over the flattened frame: columns json_error, prompt, label, problem_key, prompt_tokens."""
    return pa.DataFrameSchema(
        {
            "json_error": pa.Column(
                None, nullable=True, checks=pa.Check(lambda s: s.isna(), name="valid_json", error="not a JSON object")
            ),
            "prompt": pa.Column(
                None,
                nullable=True,
                checks=pa.Check(
                    lambda v: prompt_problem(v) is None, element_wise=True, name="valid_prompt", ignore_na=False
                ),
            ),
            "label": pa.Column(
                None,
                nullable=True,
                checks=pa.Check(
                    lambda v: label_value_problem(v) is None, element_wise=True, name="valid_label", ignore_na=False
                ),
            ),
            "problem_key": pa.Column(None, nullable=True, unique=True, report_duplicates="exclude_first"),
            "prompt_tokens": pa.Column(
                float,
                nullable=True,
                checks=pa.Check.le(max_prompt_tokens, name="prompt_within_max_prompt_len", ignore_na=True),
            ),
        },
        name=name,
        strict=True,
        coerce=False,
    )
