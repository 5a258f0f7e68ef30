"""The run's Ray cluster: bring-up and teardown of an embedded head (+ simulated nodes) or an existing cluster
(`lifecycle`), health (`health`), placement groups (`placement`), preflight checks (`preflight`), and the infra
manifests (`kuberay`, `ray_submit`). Import what you use from its module: this package re-exports nothing, so
importing one part never drags in the others."""
