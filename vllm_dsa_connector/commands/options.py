"""``vllm-dsa options``: every option of the plugin (key, environment variable, default, meaning).

The tables come from the settings classes' declarations (:mod:`vllm_dsa_connector.options`);
``--markdown`` prints the "Options" tables of docs/configuration.md (``tests/test_options_doc.py`` checks that
the document carries exactly this text).
"""

from __future__ import annotations

import argparse


def sections() -> list[tuple[str, type]]:
    """``(title, settings class)`` of every settings class users set, in the document's order (the dev
    package's last, where it is installed)."""
    from vllm_dsa_connector.admission.options import AdmissionConfig
    from vllm_dsa_connector.commands import dev_packages
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.core.transfer.copy.kernels import CopySettings
    from vllm_dsa_connector.options import RuntimeFixesOptions
    from vllm_dsa_connector.tokenizer.modes import BaseModeSettings
    from vllm_dsa_connector.tokenizer.options import CacheOptions

    return [
        ("DSAConnector, `kv_connector_extra_config` (the `bounce_*` keys tune the bounce gate):",
         ConnectorOptions),
        ("Admission (`--scheduler-cls vllm_dsa_connector.admission.DSAScheduler`), `kv_connector_extra_config` "
         "(top level or any MultiConnector child's):", AdmissionConfig),
        ("Prefix token cache (`--tokenizer-mode dsa-prefix-cache`: from the environment; keyword arguments of "
         "`PrefixTokenCache`):", CacheOptions),
        ("Prefix token cache base mode (`--tokenizer-mode dsa-prefix-cache`):", BaseModeSettings),
        ("Transport run copies (bounce gather/scatter, same-node copies):", CopySettings),
        ("Plugin:", RuntimeFixesOptions),
        *(section for dev in dev_packages() for section in dev.option_sections()),
    ]


def markdown() -> str:
    """The option tables of docs/configuration.md."""
    from vllm_dsa_connector.options import options_markdown

    return options_markdown(sections())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("--markdown", action="store_true", help="print Markdown tables (docs/configuration.md's)")


def run(args: argparse.Namespace) -> int:
    """Print every option."""
    if args.markdown:
        print(markdown(), end="")
        return 0
    from vllm_dsa_connector.options import all_options

    for title, settings_cls in sections():
        print(title.replace("`", ""))
        for o in all_options(settings_cls):
            key = "(env only)" if o.env_only else o.key
            default = "(hidden)" if o.secret and o.default else repr(o.default)
            print(f"  {key:<28} {o.env or '-':<36} default {default}\n      {o.doc}")
        print()
    return 0
