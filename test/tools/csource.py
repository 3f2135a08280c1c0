"""csource: C, C++ and CUDA source text for the repository's checks (check_backend_names,
check_funclen), with its comments blanked, and its string and character literals too where a
check asks. Newlines are kept, so line numbers hold."""
import re


def blank(text, strings=True):
    """text with // and /* */ comments replaced by spaces; string and character literals (quotes
    included) as well when strings, else kept as they are."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            if not strings:
                out.append(text[i:j])
                i = j
                continue
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)
