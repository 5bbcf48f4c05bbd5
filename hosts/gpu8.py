"""pyinfra inventory: one bare-metal or cloud 8 x RTX PRO 6000 host serving Gemma 4 31B as four TP2
replicas behind HAProxy (https://www.callstack.com/blog/optimizing-self-hosted-gemma-for-production-inference).

    GEMMASERVE_GPU8_HOST=10.0.0.12 GEMMASERVE_GPU8_USER=ubuntu pyinfra hosts/gpu8.py deploy.py

Without the variables, the host is the ssh alias `gpu8` and ssh config supplies address, user and key.
"""

import os

gpu8 = [
    (
        os.environ.get("GEMMASERVE_GPU8_HOST", "gpu8"),
        {
            **({"ssh_user": os.environ["GEMMASERVE_GPU8_USER"]} if "GEMMASERVE_GPU8_USER" in os.environ else {}),
            "_sudo": os.environ.get("GEMMASERVE_GPU8_USER", "root") != "root",
            "gemmaserve_model": "31b",
            "gemmaserve_accelerator": {"kind": "rtx-pro-6000", "count": 8},
            "gemmaserve_workload": {"max_model_len": 32768, "limit_mm_per_prompt": {"image": 4, "audio": 0}},
            "gemmaserve_serving": {"tensor_parallel_size": 2, "replicas": 4},
            # Outside Google Cloud the token is a root-only file on the host (see roles/hf_token), and so are
            # the API key store (/etc/gemmaserve/api-keys, managed with `gemmaserve keys --inventory`) and
            # the TLS certificate HAProxy serves (/etc/gemmaserve/tls.pem; access_tls_src uploads one).
            "gemmaserve_secret": {"file": "/etc/gemmaserve/hf-token"},
            "gemmaserve_allow_reboot": os.environ.get("GEMMASERVE_ALLOW_REBOOT") == "1",
        },
    )
]
