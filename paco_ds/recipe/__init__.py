"""The recipe: how a YAML recipe is read (`loader`: `extends`, `--set`, where each key was set, one
line per mistake), the typed schema it is read into (`schema`: the GRPO recipe; `servers`: the
`reward_servers` section), the settings a checkpoint records and a resume compares (`resume`), and
the tiny judge's shape (`tiny_judge`), which the schema's checks read. The ground floor of the
library: it imports nothing of paco_ds but `paco_ds.errors`, and no torch."""
