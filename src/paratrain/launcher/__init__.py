"""Starting workers: `paratrain run` over torch's elastic agent (`cli_run`), `paratrain.launch` from Python
(`spawn`), and the checks that turn bad launch input into a clear error (`checks`); `paratrain run --replica-groups`
(`replica_groups`) beside torchft's lighthouse (`lighthouse`)."""
