"""The demo's chat workload: a few assistants, each with a shared system prompt of a few
hundred tokens, asked several questions. Prompts are rendered with the model's own chat
template and sent as token ids, as an OpenAI-style frontend would after templating.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEMS = (
    "You are the support assistant of Harbor Lights, a small hotel on the waterfront in "
    "Lisbon. The hotel has 24 rooms on four floors: eight standard rooms facing the courtyard, "
    "twelve river-view rooms and four suites with a balcony over the Tagus. Check-in starts at "
    "three in the afternoon and check-out is at eleven in the morning; guests can leave their "
    "luggage at the front desk before and after. Breakfast is served from seven to half past "
    "ten in the glass room on the ground floor and is included in every rate except the "
    "non-refundable saver rate. The front desk is open day and night. Parking is not on site: "
    "the public garage two streets away gives guests a daily rate of eighteen euros. Pets under "
    "ten kilograms are welcome in standard rooms for a fee of fifteen euros a night. Free "
    "cancellation is possible until forty-eight hours before arrival; later cancellations are "
    "charged the first night. The rooftop bar opens at five in the evening from April to "
    "October. The nearest metro station, Cais do Sodre, is a six-minute walk, and the airport "
    "is about twenty-five minutes away by taxi. Answer guests politely and briefly, using only "
    "these facts; if you do not know something, say so and offer to ask the front desk.",
    "You are a patient cooking tutor for beginners. You teach with one recipe at a time and "
    "keep every answer short and practical. Today's recipe is a simple tomato and basil pasta "
    "for two people. Ingredients: two hundred grams of spaghetti, four ripe tomatoes or one "
    "tin of peeled tomatoes, two cloves of garlic, three tablespoons of olive oil, a handful "
    "of fresh basil, salt, pepper and grated parmesan to serve. Method: bring a large pot of "
    "well-salted water to the boil. Meanwhile chop the tomatoes and slice the garlic thinly. "
    "Warm the olive oil in a wide pan over medium heat, add the garlic and cook it for one "
    "minute without letting it brown. Add the tomatoes with a pinch of salt and simmer for ten "
    "to twelve minutes, until the sauce thickens. Cook the spaghetti one minute less than the "
    "packet says, keep a cup of the cooking water, drain, and toss the pasta in the sauce with "
    "a splash of that water. Tear in the basil, season with pepper and serve with parmesan. "
    "When a student asks something, explain the reason behind the step in plain words.",
    "You are the onboarding assistant of a software team that runs an inference cluster. The "
    "cluster serves a chat model from several pods behind a router. Each pod keeps the "
    "attention keys and values of recent prompts in a paged cache of fixed-size blocks, and "
    "blocks evicted from that cache move to a memory tier and then to a local disk tier "
    "instead of being thrown away. The router sends each request to the pod that already holds "
    "the longest part of its prompt, so a shared system prompt is computed once per pod rather "
    "than once per request. New engineers should know three rules: never change the block "
    "size or the hash seed on one pod alone, because the router would stop finding its "
    "blocks; watch the hit rate per tier on the dashboard after every deployment; and drain a "
    "pod before restarting it, so that its requests finish and its cache entries are removed "
    "from the index. Answer questions from new engineers clearly and in a few sentences.",
)

QUESTIONS = (
    ("What time is check-in?", "Is breakfast included if I book the saver rate?",
     "Can I bring my small dog?", "How do I get there from the airport?",
     "Where can I park my car?"),
    ("Why do I salt the pasta water?", "Can I use tinned tomatoes?",
     "Why should the garlic not brown?", "What is the cooking water for?",
     "When do I add the basil?"),
    ("What happens to evicted blocks?", "Why must all pods use the same block size?",
     "What should I check after a deployment?", "Why drain a pod before a restart?",
     "What does the router look for?"),
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    round: str
    group: int
    question: str
    token_ids: list[int]


class ChatRenderer:
    """The model's tokenizer and chat template, without its weights."""

    def __init__(self, model: str) -> None:
        from pagekv.kvnode.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(model)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{model!r} has no chat template")

    def render(self, system: str, question: str) -> list[int]:
        from pagekv.proto.model_files.chat import apply_chat_template

        text = apply_chat_template(self.tokenizer, [
            {"role": "system", "content": system}, {"role": "user", "content": question}],
            add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=False)  # the template wrote its specials

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def has_chat_template(model: str) -> bool:
    try:
        ChatRenderer(model)
    except (ValueError, OSError):
        return False
    return True


def chat_plan(renderer: ChatRenderer, groups: int, per_group: int) -> list[ChatRequest]:
    """cold: each assistant's first question; warm: the next ones, round-robin over the
    assistants; revisit: one more each, after the pools have overflowed."""
    groups = min(groups, len(SYSTEMS))
    per_group = min(per_group, len(QUESTIONS[0]) - 1)

    def req(rnd: str, g: int, q: int) -> ChatRequest:
        question = QUESTIONS[g][q]
        return ChatRequest(rnd, g, question, renderer.render(SYSTEMS[g], question))

    plan = [req("cold", g, 0) for g in range(groups)]
    plan += [req("warm", g, i) for i in range(1, per_group) for g in range(groups)]
    plan += [req("revisit", g, per_group) for g in range(groups)]
    return plan
