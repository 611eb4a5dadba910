"""Offload tiers below the KV pool: DRAM, SSD, the chain that demotes and promotes, the codec.

Import what you need from its module (`pagekv.tiers.chain`, `pagekv.tiers.dram`...): this
package imports nothing, so `tiers.codec` / `tiers.ssd_format` stay importable without torch.
"""
