"""The `deepspeed` launcher: upstream's command line, torch's elastic agent (torchrun) underneath.

`runner` turns the command line into one `python -m torch.distributed.run` command per node;
`launch_shim` runs inside each worker to add upstream's `--local_rank` argument and environment;
`world_info` holds upstream's world info (the job's hosts and slots) and the ranks each node's processes get.
"""
