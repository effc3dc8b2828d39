"""The node link: the one process per node that carries an engine replica's traffic between hosts.

    frontend node                                                   headless node
    tokenizer[i] ─scheduler-{r}-requests─▶ ┌──────────┐  CurveZMQ  ┌──────────┐ ─scheduler-{r}-requests─▶ scheduler[r]
    frontend[k]  ─control-{role}─────────▶ │ head.py  │ ◀════════▶ │member.py │ ─control-{role}─────────▶ its processes
    tokenizer[i] ◀─tokenizer-{i}-tokens─── │ (ROUTER) │  one TCP   │ (DEALER) │ ◀─tokenizer-{i}-tokens─── scheduler[r]
    frontend[k]  ◀─control-replies-…────── └──────────┘ connection └──────────┘ ◀─control-replies-…────── its processes
                                                                   per node

Every other process is unchanged: on each host it uses the ipc:// endpoints it always did (common/transport.py),
and the link binds, on each side, those whose process lives on the other host. Messages cross as they are, their
bytes never decoded; only the link's own (common/node_messages.py) are. The link owns the cross-host rules:
CurveZMQ from the cluster secret (common/cluster_secret.py), the join handshake (a node must agree with the
frontend node's terms: terms.py), heartbeats both ways, and the verdict that a node is lost. The heartbeats' rule
is common/heartbeat.py's, shared with the launchers of tensor parallelism across nodes; their carrier is this
link, which relays the replicas' traffic anyway (those launchers beat through torch.distributed's store instead).
"""
