"""What a param group is, for ZeRO."""


def is_muon_group(group: dict) -> bool:
    """Muon groups are declared by the param-group key `use_muon`, never guessed from a class name."""
    return bool(group.get("use_muon", False))
