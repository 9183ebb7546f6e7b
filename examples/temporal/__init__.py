"""A durable agent on Temporal behind runcap: the workflow orchestrates, every model and tool call is
an activity through runcap, and the run id is the workflow id (see README.md here)."""
