"""The check-agree-act helpers, for the PyTorch layer: they live in ``flashfsdp.runtime.agreement``
(below the bindings, on the control groups of ``flashfsdp.runtime.control``); this module keeps
their old import path."""

from flashfsdp.runtime.agreement import (agree, agree_and_gather, agree_from_rank0, agree_in_group, agree_on_list,
                                         all_gather_bytes, all_gather_fixed, error_payload, global_rank,
                                         global_world_size, operation_name, raise_agreed, raise_group_errors,
                                         raise_own)

__all__ = ["agree", "agree_and_gather", "agree_from_rank0", "agree_in_group", "agree_on_list", "all_gather_bytes",
           "all_gather_fixed", "error_payload", "global_rank", "global_world_size", "operation_name", "raise_agreed",
           "raise_group_errors", "raise_own"]
