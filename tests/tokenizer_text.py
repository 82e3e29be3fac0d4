"""Mixed text for tokenizer parity tests: code, English, other scripts, emoji, odd whitespace (~4,000 characters)."""

CODE = '''def route(logits: torch.Tensor, bias=None) -> tuple[int, ...]:
    """Pick the top-k experts; ties go to the lower id."""
    if bias is not None:
        logits = logits + bias  # [T, E]
    picks = torch.topk(logits, k=8, dim=-1).indices
    return tuple(int(i) for i in picks[0])


class LruPolicy:
    def __init__(self, slots):
        self.slots, self._order = slots, {}

    def __repr__(self):
        return f"LruPolicy(slots={self.slots!r}, held={len(self._order)})"

for (i, x) in enumerate([3.14, -2e-5, 0x1F, 1_000_000]):
\tprint(i, x, "{:>8.3f}".format(x), end='\\n')
if a!=b and c<=d or e>=f: pass; x += 1; y -= 2; z **= 3
// C++: std::vector<int> v{1, 2, 3}; for (auto& e : v) { e <<= 1; }
SELECT id, name FROM experts WHERE layer = 12 AND hits > 0.85 ORDER BY hits DESC;
'''

ENGLISH = '''The quick brown fox doesn't jump over the lazy dog; it's 3:45 p.m. and we've got 1,234 tokens left.
"Mixture-of-Experts" models route each token to a few experts — the rest sit idle. Isn't that neat?
I'll say it again: they're fast, they'd be faster with a warm cache, and you'll see 84.5% hit rates.
Mr. O'Neil's e-mail (sent 2024-05-17T09:30:00Z) read: "Ship it!!!"   Three spaces, then a tab\there.
Multiple

blank lines, trailing spaces   
and CRLF line ends.\r\nDone.  '''

OTHER_SCRIPTS = '''Привет, мир! Как дела? Эксперты маршрутизируют токены по слоям.
Καλημέρα κόσμε· η δρομολόγηση των ειδικών είναι γρήγορη.
你好，世界！专家混合模型把每个词元送到少数几个专家。日本語のテキストも少し：こんにちは、世界。
안녕하세요 세계. مرحبا بالعالم، هذا نص عربي. नमस्ते दुनिया, यह हिंदी पाठ है। שלום עולם.
Tiếng Việt có dấu: Xin chào thế giới. Türkçe: İstanbul'da ğüşıöç. Ελληνικά ΑΒΓ, Ünïcödé, naïve café, ﬁne ligature.
'''

EMOJI = '''Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 ❤️‍🔥 ✅ ⚠️ 🚀✨ — and math: ∑ᵢ xᵢ² ≤ ∞, α→β, ½ ¾ ℃ №5.
Symbols: © ® ™ § ¶ • … ‰ ← ↑ → ↓ ⇒ ∀x∃y, box ┌─┐ │ └─┘, zero-width:\u200b|\u200d|\ufeff end.
'''

MIXED_TEXT = (CODE + ENGLISH + OTHER_SCRIPTS + EMOJI) * 2
