"""What crosses the boundary between the service and the engines, torch-free: the control plane (and the
`whitney` command's help) imports this package without loading torch.

  config.py   EngineConfig: every engine default, once
"""
