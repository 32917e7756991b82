"""The bench: workloads, the processes of a run, the router, statistics, the regime map."""
