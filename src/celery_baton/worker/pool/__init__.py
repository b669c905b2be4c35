"""What runs in the pool process, around the task body: the run's end recorded there,
the results of the publishes a run stands for, and ``fence()``."""
