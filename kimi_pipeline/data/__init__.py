"""The prompt data: the `validate` stage's checks (`validate.run_validate`: DAPO/AIME-format rows through the
pandera `schemas` and the row facts of `rows`, each bad row quarantined with its reason), and the tiny recipe's
assets, built offline and deterministically by `tiny_assets` (behind `kimi data make-tiny`): `synthetic` problems,
its `tokenizer` and the `warm_start` base policy; `tiny_k25` derives the K2.5-shaped checkpoint pair from them."""
