"""Solve stage: ModelGraph x ClusterSpec -> Plan (being built: issue 4)."""


def plan(model, cluster_spec, **kwargs):
    raise NotImplementedError("autopar.plan is being built (issue 4)")
