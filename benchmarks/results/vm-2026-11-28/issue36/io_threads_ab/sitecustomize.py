import os
if os.environ.get("UCP_IO_THREADS"):
    import builtins, functools, dataclasses
    _orig_import = builtins.__import__
    state = {"done": False}
    def install():
        from ucp_dcp.dcp import reader as R
        init = R.UCPStorageReader.__init__
        n = int(os.environ["UCP_IO_THREADS"])
        @functools.wraps(init)
        def w(self, *a, **k):
            init(self, *a, **k)
            self.options = dataclasses.replace(self.options, io_threads=n)
        R.UCPStorageReader.__init__ = w
    def imp(name, *a, **k):
        m = _orig_import(name, *a, **k)
        if not state["done"] and name.startswith("ucp_dcp"):
            state["done"] = True
            try:
                import ucp_dcp.dcp.reader
                install()
            except Exception:
                state["done"] = False
        return m
    builtins.__import__ = imp
