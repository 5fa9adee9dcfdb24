"""CNI plugins of cns; stdlib only and cheap to import, because the runtime starts one per pod."""
