"""The pure core: pool state machine and scaling math. No IO, no asyncio."""
