import os
mode = os.environ.get("FORCE_ACCESS")
if mode:
    from ucp_dcp.dcp import options as _o
    _orig = _o.ReadOptions.__post_init__
    def _post(self):
        if self.access == "auto":
            object.__setattr__(self, "access", mode)
        _orig(self)
    _o.ReadOptions.__post_init__ = _post
