"""Text that users send, generated from templates: chat conversations and messages with personal data.

Prompts sent to an assistant are chat-formatted and often carry names, e-mail addresses, phone and
account numbers. None of that ships with Python, so it is generated here from fixed lists and a
seeded generator. The training and test sides draw from disjoint halves of every list (names,
streets, employers, templates), so a test document's personal details never appear in training and
the attacks cannot score by having memorised them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

FIRST = (
    "Amelia Oliver Priya Mateo Sofia Kenji Fatima Lucas Ingrid Tomasz Aisha Diego Hannah Ravi Chloe Emeka "
    "Yuki Nora Pablo Leila Henrik Mei Omar Clara Santiago Zara Felix Anya Kwame Elena Jonas Isla Arjun Maya "
    "Viktor Lina Samuel Rosa Dmitri Ayla"
).split()
LAST = (
    "Hartmann Okafor Lindqvist Moreau Tanaka Kowalski Haddad Fernandes O'Brien Novak Castillo Brennan "
    "Achterberg Svensson Rahman Whitfield Delacroix Nakamura Ferreira Kaminski Gallagher Petrov Mwangi "
    "Rossi Halvorsen Quinn Yilmaz Abernathy Sato Varga Lopez Eriksen Mbeki Duarte Fischer Kovacs"
).split()
STREETS = (
    "Maple Avenue|Harbour Road|Linden Street|Old Mill Lane|Kingsway|Birch Close|Station Road|Cedar Drive|"
    "Riverside Walk|Elm Grove|Church Street|Orchard Way|Park Terrace|Willow Court|High Street|Meadow Rise"
).split("|")
CITIES = "Leeds|Porto|Utrecht|Gdansk|Lyon|Tampere|Bristol|Graz|Aarhus|Bilbao|Cork|Brno|Ghent|Turin".split("|")
EMPLOYERS = (
    "Northwind Logistics|Bluefin Analytics|Crescent Health|Ironbridge Capital|Solace Insurance|"
    "Greenleaf Foods|Vantage Telecom|Harbor Legal|Summit Pharmacy|Brightside Energy|Oakridge Bank|Pinecrest School"
).split("|")
DOMAINS = "mailbox.org|fastmail.com|proton.me|gmail.com|outlook.com|yahoo.com|posteo.de|icloud.com".split("|")


@dataclass(frozen=True)
class Person:
    name: str
    email: str
    phone: str
    address: str
    birthday: str
    account: str
    employer: str


def _half(items: tuple | list, test: bool) -> list:
    """Every other item: the training side gets the even ones, the test side the odd ones."""
    return list(items)[int(test) :: 2]


def person(rng: random.Random, test: bool) -> Person:
    first, last = rng.choice(_half(FIRST, test)), rng.choice(_half(LAST, test))
    sep = rng.choice([".", "_", ""])
    email = f"{first.lower()}{sep}{last.lower().replace(chr(39), '')}{rng.randint(1, 99)}@{rng.choice(DOMAINS)}"
    phone = (
        f"+{rng.choice([44, 49, 33, 31, 1])} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    )
    address = f"{rng.randint(1, 240)} {rng.choice(_half(STREETS, test))}, {rng.choice(_half(CITIES, test))}"
    birthday = f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(1950, 2005)}"
    account = "".join(str(rng.randint(0, 9)) for _ in range(rng.choice([8, 10, 12])))
    return Person(f"{first} {last}", email, phone, address, birthday, account, rng.choice(_half(EMPLOYERS, test)))


# Personal-data messages: each a function of (person, other person, rng), so the wording varies too.
Template = Callable[[Person, Person, random.Random], str]
MESSAGES: tuple[Template, ...] = (
    lambda p, q, r: f"Hi {q.name.split()[0]}, my new number is {p.phone} and I moved to {p.address}. "
    f"Could you update my file? Thanks, {p.name}",
    lambda p, q, r: f"Patient: {p.name}. Date of birth: {p.birthday}. Contact: {p.email}, {p.phone}. "
    f"Referred by Dr. {q.name} for a follow-up appointment next week.",
    lambda p, q, r: f"Please wire {r.randint(120, 9800)} EUR from account {p.account} to {q.name}, "
    f"account {q.account}. Reference: invoice {r.randint(1000, 99999)}.",
    lambda p, q, r: f"Dear {q.name}, I am writing to confirm that {p.name} has worked at {p.employer} since "
    f"{r.randint(2005, 2023)}. You can reach me at {q.email}.",
    lambda p, q, r: f"Shipping to: {p.name}, {p.address}. Phone {p.phone}. Leave the parcel with the neighbour, "
    f"{q.name}, if nobody answers.",
    lambda p, q, r: f"Login details for {p.name}: username {p.email}, recovery phone {p.phone}, "
    f"security answer '{q.name.split()[1]}'.",
    lambda p, q, r: f"{p.name} ({p.birthday}) applied for the position at {q.employer}; references: "
    f"{q.name}, {q.phone}.",
    lambda p, q, r: f"Reminder: {p.name} owes {q.name} {r.randint(20, 900)} pounds for the flat at {p.address}; "
    f"pay to account {q.account}.",
)
SYSTEMS = (
    "You are a careful assistant that helps people with everyday paperwork.",
    "You are a friendly helper. Answer briefly and politely.",
    "You help users write and edit messages. Keep their tone.",
    "You are an assistant for a small office. Be precise with names and numbers.",
    "Answer the user's questions in plain English and ask when something is unclear.",
    "You are a writing assistant; rewrite texts so they are clear and short.",
)
ASKS = (
    "Can you make this message sound more polite?",
    "Please fix the grammar in the following:",
    "Summarise this for my records:",
    "Turn this into a formal email:",
    "Is anything missing from this note?",
    "Translate the tone of this into something friendlier:",
)
REPLIES = (
    "Here is a more polite version:",
    "Sure. Corrected text:",
    "Summary:",
    "Here is a formal version you can send:",
    "It looks complete. A slightly clearer wording would be:",
    "Of course. Friendlier version:",
)


def personal_text(rng: random.Random, test: bool, messages: int = 12) -> str:
    """A document of unrelated personal-data messages, one per paragraph."""
    templates = _half(MESSAGES, test)
    return "\n\n".join(rng.choice(templates)(person(rng, test), person(rng, test), rng) for _ in range(messages))


def conversation(rng: random.Random, test: bool, turns: int = 3) -> list[dict[str, str]]:
    """A chat with a system prompt and `turns` user requests about personal messages, with replies."""
    messages = [{"role": "system", "content": rng.choice(_half(SYSTEMS, test))}]
    templates, asks, replies = _half(MESSAGES, test), _half(ASKS, test), _half(REPLIES, test)
    for _ in range(turns):
        i = rng.randrange(len(asks))
        p, q = person(rng, test), person(rng, test)
        messages.append({"role": "user", "content": f"{asks[i]} {rng.choice(templates)(p, q, rng)}"})
        messages.append({"role": "assistant", "content": f"{replies[i]} {rng.choice(templates)(p, q, rng)}"})
    return messages
