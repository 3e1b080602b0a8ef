"""Disaggregated prefill and decode: a request's KV blocks and recurrent state move from the worker that
prefilled it to the worker that decodes it (docs/architecture.md, "Disaggregation").

- messages.py: what travels on the ZeroMQ control channel (a worker's endpoint, where a prefilled request waits);
- layout.py: the registered tensors of a worker and the byte regions of given blocks and state slots in them;
- agent.py: the NIXL agent (registration once, reads, notifications, the deadline NIXL does not have);
- leases.py: the prefill side's hold on what it prefilled, until the decode side says it is done or time runs out;
- connector_scheduler.py: the connector's scheduler half: what to hold, pull and release, decided with the scheduler's
  books; its orders travel in the step plan;
- connector_worker.py: the connector's worker half: carries out the orders over the agent and reports what happened.
"""
