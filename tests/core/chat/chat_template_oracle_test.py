#!/usr/bin/env python3
"""Our chat-template renderer against python3-jinja2 set up as HF transformers renders chat
templates (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls,
transformers' tojson, raise_exception, strftime_now).

Every template in tests/data/chat_templates/ is rendered for a set of conversations -- with
and without a system message, several turns, multi-line and non-ASCII content, leading and
trailing white space, a trailing assistant turn, tools where the template takes them, and
conversations the template rejects. Ours must give the same bytes, or an error where Jinja2
raises; a template we refuse to parse must be one that uses a construct we name as
unsupported (never silently different output).

usage: chat_template_oracle_test.py PATH/TO/chat_template_helper TEMPLATE_DIR
"""
import datetime
import json
import os
import subprocess
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

# Templates we deliberately refuse, and the construct the refusal must name.
REFUSED = {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "macro"}


class RaisedByTemplate(Exception):
    pass


def hf_environment():
    def raise_exception(message):
        raise RaisedByTemplate(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def msg(role, content):
    return {"content": content, "role": role}  # keys sorted, as the helper's JSON reader keeps


TOOL = {"function": {"description": "Get the weather in a city",
                     "name": "get_weather",
                     "parameters": {"properties": {"city": {"description": "City name",
                                                            "type": "string"}},
                                    "required": ["city"], "type": "object"}},
        "type": "function"}

CONVERSATIONS = [
    [msg("user", "Hello!")],
    [msg("system", "You are a helpful assistant."), msg("user", "What is 2+2?")],
    [msg("user", "Hi"), msg("assistant", "Hello! How can I help?"), msg("user", "Tell me a joke")],
    [msg("system", "Be brief.\nAnswer in French."), msg("user", "  Bonjour  \n"),
     msg("assistant", "Salut ! \u00c7a va ?"), msg("user", "Tr\u00e8s bien, merci \U0001F600")],
    [msg("user", "Write code"), msg("assistant", "```python\nprint('hi')\n```")],
    [msg("user", "line1\n\nline2\t{{ not a tag }} {% neither %}")],
    [msg("user", "Why?"), msg("assistant", "<think>\nBecause.\n</think>\n\nIt is so.")],
    # Conversations some templates reject.
    [msg("assistant", "I speak first"), msg("user", "ok")],
    [msg("user", "a"), msg("user", "b")],
    [],
]


def contexts():
    out = []
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ctx = {"add_generation_prompt": gen, "bos_token": "<s>", "eos_token": "</s>",
                   "messages": conv}
            out.append(ctx)
    out.append({"add_generation_prompt": True, "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "messages": CONVERSATIONS[1],
                "date_string": "26 Nov 2026"})
    out.append({"add_generation_prompt": True, "bos_token": "", "eos_token": "",
                "messages": CONVERSATIONS[2], "enable_thinking": False})
    out.append({"add_generation_prompt": True, "bos_token": "", "eos_token": "",
                "messages": CONVERSATIONS[1], "tools": [TOOL]})
    return out


# Small templates for the corners the stored ones do not reach: white-space control under
# trim_blocks / lstrip_blocks, comments, loop variables and controls, filters, tests, slices,
# string and dict methods, number printing, tojson, namespaces, scoping, and errors.
SYNTHETIC = [
    "a\n  {% if true %}\n    x\n  {% endif %}\nb\n",
    "a  {%+ if true %}x{% endif +%}\n  y\n  {# note #}\nz {#- trimmed -#}  w",
    "{% for m in messages %}\n  [{{ loop.index }}/{{ loop.length }} {{ loop.first }} {{ loop.last }}"
    " {{ loop.revindex0 }}] {{ m.role | upper }}: {{ m['content'] | trim | length }}\n{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index0 }}{{ m.role[0] }}"
    "{% else %}none{% endfor %}|{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
    "{% if i > 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.5 * 2 }}"
    " {{ 0.1 + 0.2 }} {{ 1e20 * 10 }} {{ 3 - 5 }} {{ 'ab' * 3 }} {{ 10 / 4 }} {{ 1 / 3 }}",
    "{{ [1, 'a', none, true, 2.5] }} {{ {'k': 'v', 'n': [1, 2]} }} {{ none }} {{ true }}"
    " {{ undefined_var }}|{{ 'x' ~ 1 ~ none }}",
    "{{ messages | tojson }}|{{ {'a': '\u00e9\\n\"', 'b': [1, 2.0, none, false]} | tojson(indent=2) }}",
    "{{ 'Hello World'.lower() }} {{ 'x'.upper() }} {{ '  pad  '.strip() }}|{{ 'xxhixx'.strip('x') }}"
    " {{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'abc'.startswith('ab') }}"
    " {{ 'abc'.endswith('bc') }} {{ 'aXbXc'.replace('X', '-') }} {{ 'hello world' | title }}"
    " {{ 'hELLO' | capitalize }}",
    "{{ 'abcdef'[1:4] }} {{ 'abcdef'[::-1] }} {{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3][-1] }}"
    " {{ 'abc'[-2] }} {{ [1, 2, 3, 4, 5][::2] }} {{ messages[-1].role }} {{ messages[5] is defined }}",
    "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set local = m.role %}{% endfor %}{{ ns.n }} [{{ local }}] {% set x = 5 %}{{ x }}",
    "{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ 1 is number }} {{ {} is mapping }}"
    " {{ [] is iterable }} {{ 3 is odd }} {{ 4 is even }} {{ 'a' in 'cat' }} {{ 2 in [1, 2] }}"
    " {{ 'k' in {'k': 1} }} {{ 'z' not in 'cat' }} {{ 1 < 2 < 3 }} {{ 'b' > 'a' }}"
    " {{ 1 == 1.0 }} {{ true == 1 }} {{ 'x' if false else 'y' }} {{ 'x' if false }}.",
    "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
    " {{ messages | rejectattr('role', 'equalto', 'user') | map(attribute='role') | join(',') }}"
    " {{ [3, 0, 1] | select | list }} {{ [1, 2] | first }} {{ [1, 2] | last }}"
    " {{ x | default('dflt') }} {{ '' | default('e', true) }} {{ '12' | int + 1 }}"
    " {{ {'b': 1, 'a': 2} | items | list }} {{ 'ab\ncd' | indent(2) }} {{ -3 | abs }}",
    "{% for k, v in {'one': 1, 'two': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
    "{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b', 'no') }} {{ {'a': 1}.get('b') }}",
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system please') }}{% endif %}ok",
    "{{ 'a' + 1 }}",
    "{{ undefined_var.attr }}",
    "{%- for m in messages -%}\n    {{- m.content -}}\n{%- endfor -%}\n",
    "x\r\n{% if true %}\r\n y\r\n{% endif %}\r\n",
]


def main():
    helper, template_dir = sys.argv[1], sys.argv[2]
    import tempfile
    synthetic_dir = tempfile.mkdtemp(prefix="chat_templates_")
    for i, text in enumerate(SYNTHETIC):
        with open(os.path.join(synthetic_dir, "synthetic_%02d.jinja" % i), "w",
                  encoding="utf-8", newline="") as f:
            f.write(text)
    env = hf_environment()
    ctxs = contexts()
    stdin = "".join(json.dumps(c, sort_keys=True) + "\n" for c in ctxs)
    failures = 0
    rendered = 0
    names = sorted(f for f in os.listdir(template_dir) if f.endswith(".jinja"))
    paths = [os.path.join(template_dir, n) for n in names]
    paths += sorted(os.path.join(synthetic_dir, f) for f in os.listdir(synthetic_dir))
    names += sorted(os.listdir(synthetic_dir))
    for name, path in zip(names, paths):
        with open(path, encoding="utf-8", newline="") as f:
            source = f.read()
        out = subprocess.run([helper, path], input=stdin,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        lines = out.splitlines()
        if name in REFUSED:
            ok = lines and lines[0].startswith("PARSE_ERROR UNIMPLEMENTED") and \
                REFUSED[name] in lines[0]
            if not ok:
                failures += 1
                print("%s: expected a refusal naming %r, got %r" % (name, REFUSED[name], lines[:1]))
            continue
        if lines and lines[0].startswith("PARSE_ERROR"):
            failures += 1
            print("%s: %s" % (name, lines[0]))
            continue
        template = env.from_string(source)
        for ctx, line in zip(ctxs, lines):
            try:
                want = template.render(**ctx)
                want_err = None
            except Exception as e:  # noqa: BLE001 - any Jinja2 error must be ours too
                want, want_err = None, e
            if want_err is not None:
                if not line.startswith("ERROR"):
                    failures += 1
                    print("%s: Jinja2 raised %r, ours rendered\n  ctx %s" % (
                        name, want_err, json.dumps(ctx)[:200]))
                continue
            if line.startswith("ERROR"):
                failures += 1
                print("%s: ours failed (%s) where Jinja2 rendered\n  ctx %s" % (
                    name, line, json.dumps(ctx)[:200]))
                continue
            have = bytes.fromhex(line).decode("utf-8")
            rendered += 1
            if have != want:
                failures += 1
                if failures < 15:
                    print("%s: differs\n  ctx  %s\n  want %r\n  have %r" % (
                        name, json.dumps(ctx)[:200], want, have))
        if len(lines) != len(ctxs):
            failures += 1
            print("%s: %d outputs for %d contexts" % (name, len(lines), len(ctxs)))
    print("%d templates, %d renders byte-identical to python3-jinja2 %s; %d failures" % (
        len(names), rendered, jinja2.__version__, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
