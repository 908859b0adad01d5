"""Upstream's path of the ZeRO-to-fp32 consolidation: deepspeed/checkpoint/zero_to_fp32.py holds it.

    python -m deepspeed.utils.zero_to_fp32 <checkpoint_dir> <output_dir> [-t TAG] [--exclude_frozen_parameters]
"""

from deepspeed.checkpoint.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                               get_fp32_state_dict_from_zero_checkpoint,
                                               load_state_dict_from_zero_checkpoint, main)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "main"]

if __name__ == "__main__":
    main()
