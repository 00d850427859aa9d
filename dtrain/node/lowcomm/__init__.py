"""The low-communication sync mode (`--sync low-comm`, docs/low-communication.md): DiLoCo-style rounds of inner
AdamW updates on each node's own data and packets, then one all-reduce of the pseudo-gradients and an outer Nesterov
step."""
