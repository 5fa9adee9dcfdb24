"""`cns simulate`: a discrete-event capacity planner running the real pool and control-plane code.

Every simulated node owns a real `cns.core.pool.Pool` scaled by `next_request`; every subnet is
run by the controller's planner (`plan_round`); node pools scale with `cns.sim.escalator`. The
simulator adds only what a cluster adds around them: time, pods, a scheduler and latencies.
Nothing here does IO at import time; matplotlib is imported by `cns.sim.plot` only.
"""
