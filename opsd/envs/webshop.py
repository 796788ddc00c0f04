"""WebShop adapter: an HTTP client for a running WebShop server (princeton-nlp/WebShop's Flask app).

The server (setup: opsd/envs/WEBSHOP.md) serves the shop's pages; this client
plays WebShop's text environment over HTTP: it fetches a page, turns its HTML
into a text observation (visible text chunks joined by " [SEP] ", as WebShop's
"simple" text mode does) and a list of admissible commands, and maps actions
to the requests a browser would make:

    search[<keywords>]   only on a page with the search box (POST search_query to its form)
    click[<name>]        a button ("Back to Search", "< Prev", "Next >", "Description",
                         "Features", "Reviews", "Buy Now"...), a product ASIN or an option
                         value; the client follows the link / form / radio URL the page gives

Clicks match case-insensitively. Anything else is an invalid action: flagged,
nothing sent, state unchanged. "click[Buy Now]" ends the episode with the
reward the server's done page reports (r in [0, 1]); won = (r == 1).
Navigation state lives in the server's URLs, so sibling episodes of one goal
can share the session "fixed_<goal index>".

Metrics (AlignOPSD eq. 15): `webshop_score` (mean r x 100) and
`webshop_accuracy` (% of episodes with r == 1).
"""

from __future__ import annotations

import math
import re
import time
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from opsd.config import EnvSection
from opsd.envs.base import ClosingEnv, EnvContext, EnvPrompt, EnvStep, Task, cap

NAME = "webshop"
ACTION_TAGS = ("action",)
METRIC = "score"
SEARCH_COMMAND = "search[<keywords>]"  # the admissible entry for "any search"; the keywords are the agent's
MAX_ACTION_CHARS = 500
SETUP_DOC = "opsd/envs/WEBSHOP.md"
MAX_PAGE_BYTES = 4_000_000  # default cap on one page's body (WebShop's pages are tens of KB)
REWARD_LABEL = "Your score (min 0.0, max 1.0)"  # the text before the score on WebShop's done page
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")

PROMPT = EnvPrompt(
    system={
        "action": (
            "You are an expert autonomous agent operating in the WebShop e-commerce platform. "
            "Your task is to buy the product that best matches the instruction. "
            "Use search[<keywords>] on a page with a search box and click[<item>] to click a product ID, "
            "an option value or a button such as Next >, < Prev, Back to Search, Description or Buy Now. "
            "Each turn, {pick} and reply with it inside <action></action>, "
            "for example <action>search[red cotton t-shirt]</action>."
        ),
        "think": (
            "You are an expert autonomous agent operating in the WebShop e-commerce platform. "
            "Your task is to buy the product that best matches the instruction. "
            "Use search[<keywords>] on a page with a search box and click[<item>] to click a product ID, "
            "an option value or a button such as Next >, < Prev, Back to Search, Description or Buy Now. "
            "Each turn, reason step by step inside <think></think>, then {pick} and reply with it "
            "inside <action></action>."
        ),
    },
    # A made-up exchange (no real WebShop goal or product) showing the reply format.
    example=(
        "WebShop [SEP] Instruction: [SEP] i need a blue ceramic coffee mug, and price lower than 20.00 dollars "
        "[SEP] Search",
        [SEARCH_COMMAND],
        {
            "action": "<action>search[blue ceramic coffee mug]</action>",
            "think": "<think>I am on the search page. I should search for the product type with its key "
                     "attributes.</think><action>search[blue ceramic coffee mug]</action>",
        },
    ),
)

# Reporting buckets: WebShop's five product categories, recognised from the instruction's words.
# The first group (in this order) with a word in the instruction wins; none -> "other".
# Furniture and electronics come first so "coffee table" or "shoe rack" and "phone case" are not
# taken for food / fashion.
CATEGORY_KEYWORDS: dict[str, tuple[str, ...]] = {
    "furniture": ("sofa", "couch", "chair", "table", "desk", "bed", "mattress", "shelf", "shelves", "bookcase",
                  "cabinet", "dresser", "nightstand", "ottoman", "stool", "bench", "wardrobe", "rack", "furniture",
                  "headboard", "futon", "loveseat", "recliner", "sectional", "vanity", "drawer"),
    "electronics": ("headphone", "headphones", "earbuds", "earphones", "speaker", "charger", "cable", "usb", "hdmi",
                    "laptop", "tablet", "phone", "camera", "tv", "television", "monitor", "keyboard", "mouse",
                    "bluetooth", "battery", "router", "adapter", "projector", "microphone", "electronics", "remote",
                    "smartwatch", "console", "ipad", "iphone"),
    "makeup": ("makeup", "lipstick", "lip", "mascara", "eyeliner", "eyeshadow", "foundation", "concealer", "blush",
               "nail", "polish", "shampoo", "conditioner", "hair", "skin", "serum", "moisturizer", "lotion",
               "perfume", "fragrance", "cream", "wig", "deodorant", "cosmetic", "cosmetics", "brush", "toothpaste",
               "soap", "sunscreen", "beauty"),
    "food": ("food", "snack", "snacks", "coffee", "tea", "chocolate", "candy", "cookie", "cookies", "sauce",
             "gluten", "protein", "nuts", "cereal", "juice", "spice", "seasoning", "jerky", "keto", "grocery",
             "chips", "crackers", "honey", "oil", "flour", "pasta", "rice", "drink", "gourmet", "sugar"),
    "fashion": ("shirt", "t-shirt", "tshirt", "dress", "jeans", "pants", "shoes", "shoe", "sneakers", "boots",
                "sandals", "slippers", "heels", "jacket", "coat", "hoodie", "sweater", "sweatshirt", "skirt",
                "shorts", "socks", "hat", "cap", "bra", "underwear", "leggings", "blouse", "swimsuit", "bikini",
                "pajama", "pajamas", "vest", "loafers", "clothing", "belt", "scarf", "gloves", "tops"),
}
CATEGORIES = (*CATEGORY_KEYWORDS, "other")


class WebShopError(RuntimeError):
    """The WebShop server failed (unreachable, timed out, answered an HTTP error, an overlong page
    or a purchase page without a valid score)."""


def webshop_category(instruction: str) -> str:
    """The reporting category of a WebShop instruction: "furniture", "electronics", "makeup", "food",
    "fashion" (WebShop's five product categories) or "other".

    The first group of CATEGORY_KEYWORDS (in its order) that has a word of the
    instruction wins; a plural "s" is ignored ("mugs" matches "mug").
    """
    words = set(re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", instruction.lower()))
    words |= {w[:-1] for w in words if w.endswith("s") and len(w) > 3}
    for category, keys in CATEGORY_KEYWORDS.items():
        if words.intersection(keys):
            return category
    return "other"


def _check_rewards(rewards: list[float]) -> list[float]:
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("no episodes: WebShop Score/Acc need at least one final reward")
    bad = [r for r in values if not 0.0 <= r <= 1.0]  # also rejects NaN
    if bad:
        raise ValueError(f"WebShop final rewards must lie in [0, 1]; got {bad[:3]}")
    return values


def webshop_score(rewards: list[float]) -> float:
    """WebShop Score (AlignOPSD eq. 15): the mean final reward over episodes, times 100.

    rewards: one final reward r in [0, 1] per episode (the server's purchase
    score; 0 for an episode that bought nothing). Returns a value in [0, 100].
    Raises ValueError on an empty list or a reward outside [0, 1] / NaN.
    Example: [1.0, 0.5, 0.0] -> 50.0.
    """
    values = _check_rewards(rewards)
    return 100.0 * sum(values) / len(values)


def webshop_accuracy(rewards: list[float]) -> float:
    """WebShop Acc / success rate (AlignOPSD eq. 15): the percentage of episodes with final reward r == 1.

    rewards: one final reward in [0, 1] per episode. Returns a value in
    [0, 100]. Raises ValueError on an empty list or a reward outside [0, 1].
    Example: [1.0, 0.5, 0.0, 1.0] -> 50.0.
    """
    values = _check_rewards(rewards)
    return 100.0 * sum(1 for r in values if r >= 1.0 - 1e-9) / len(values)


# --------------------------------------------------------------------------- HTML -> observation + clickables

_SKIP_TAGS = {"head", "script", "style", "title", "iframe", "noscript", "template"}
_VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Page(HTMLParser):
    """One WebShop page: visible text chunks, clickables, the search form, the instruction and the reward.

    clickables: lowercased name -> (name, method, url, kind, option group);
    kind "button" (class "btn", outside the search form: its form's method and
    action), "product" (class "product-link": its href) or "option" (a radio
    input: its data-url; group = the radio's name, e.g. "color"). The first
    clickable of a name wins.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[str] = []
        self.clickables: dict[str, tuple[str, str, str]] = {}
        self.search: tuple[str, str, str] | None = None  # (method, action, input name)
        self.instruction = ""
        self.reward_text: str | None = None  # all text of the #reward element (None: not a done page)
        self.reward_value: str | None = None  # the text of the first <pre> inside #reward
        self._stack: list[tuple[str, bool, dict[str, str]]] = []  # (tag, hidden, attrs)
        self._form: dict[str, str] | None = None
        self._capture: dict[str, list[str]] = {}  # "button" / "link" / "instruction" / "reward" -> text parts
        self._link: str = ""
        self._in_instruction = 0
        self._instruction_done = False

    def _hidden(self) -> bool:
        return any(hidden for _, hidden, _ in self._stack)

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: (v or "") for k, v in attrs_list}
        classes = attrs.get("class", "").split()
        if tag == "form":
            self._form = attrs
        elif tag == "input":
            if attrs.get("id") == "search_input" and self._form is not None:
                self.search = (self._form.get("method", "get").upper(), self._form.get("action", ""),
                               attrs.get("name", "search_query"))
                self._form["_search"] = "1"
            elif attrs.get("type", "").lower() == "radio" and attrs.get("value") and attrs.get("data-url"):
                self._add(attrs["value"], "GET", attrs["data-url"], "option", attrs.get("name", ""))
        if tag in _VOID_TAGS:
            return
        style = attrs.get("style", "").replace(" ", "").lower()
        hidden = tag in _SKIP_TAGS or "hidden" in attrs or "display:none" in style
        self._stack.append((tag, hidden, attrs))
        if tag == "button" and "btn" in classes:
            self._capture["button"] = []
        elif tag == "a" and "product-link" in classes:
            self._capture["link"], self._link = [], attrs.get("href", "")
        if attrs.get("id") == "reward":
            self._capture["reward"] = []
        elif tag == "pre" and "reward" in self._capture and self.reward_value is None:
            self._capture["reward_value"] = []
        if attrs.get("id") == "instruction-text":
            self._in_instruction = len(self._stack)
        elif tag == "h4" and self._in_instruction and not self._instruction_done:
            self._capture["instruction"] = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._form = None
        if tag in _VOID_TAGS or tag not in (t for t, _, _ in self._stack):
            return  # a stray end tag (WebShop's done page has some)
        while self._stack:
            open_tag, _, attrs = self._stack.pop()
            self._close(open_tag, attrs)
            if open_tag == tag:
                break

    def _close(self, tag: str, attrs: dict[str, str]) -> None:
        if tag == "button" and "button" in self._capture:
            label = " ".join("".join(self._capture.pop("button")).split())
            form = self._form or {}
            if label and not form.get("_search"):
                self._add(label, form.get("method", "get").upper(), form.get("action", ""), "button")
        elif tag == "a" and "link" in self._capture:
            self._add(" ".join("".join(self._capture.pop("link")).split()), "GET", self._link, "product")
        elif tag == "h4" and "instruction" in self._capture:
            text = " ".join("".join(self._capture.pop("instruction")).split())
            self.instruction = re.sub(r"^Instruction:\s*", "", text)
            self._instruction_done = True
        if tag == "pre" and "reward_value" in self._capture:
            self.reward_value = " ".join("".join(self._capture.pop("reward_value")).split())
        if attrs.get("id") == "reward" and "reward" in self._capture:
            self.reward_text = " ".join("".join(self._capture.pop("reward")).split())
        if self._in_instruction > len(self._stack):
            self._in_instruction = 0

    def handle_data(self, data: str) -> None:
        for parts in self._capture.values():
            parts.append(data)
        text = " ".join(data.split())
        if text and not self._hidden():
            self.texts.append(text)

    def _add(self, name: str, method: str, url: str, kind: str, group: str = "") -> None:
        key = name.lower()
        if name and url and key not in self.clickables and key != "search":
            self.clickables[key] = (name, method, url, kind, group)

    def reward(self) -> float | None:
        """The purchase score r in [0, 1] on a done page, else None (no #reward element).

        WebShop's done page (web_agent_site/templates/done_page.html) renders
        `<h3 id="reward">Your score (min 0.0, max 1.0)<pre>{{ reward }}</pre></h3>`:
        the score is the text of the <pre> (without one, the element's text after
        the label). Raises WebShopError when that text is not exactly one finite
        number in [0, 1] (missing, blank, "nan", 1e5...): never a guessed reward.
        """
        if self.reward_text is None:
            return None
        value = self.reward_value
        if value is None:
            text = self.reward_text
            value = text[len(REWARD_LABEL):].strip() if text.startswith(REWARD_LABEL) else text
        if not _NUMBER.fullmatch(value):
            raise WebShopError(f"the WebShop purchase page's #reward holds no score: {self.reward_text[:200]!r}")
        r = float(value)
        if not (math.isfinite(r) and 0.0 <= r <= 1.0):
            raise WebShopError(f"the WebShop purchase page's score {value[:50]!r} is not in [0, 1]")
        return r


def parse_page(html_text: str) -> _Page:
    """Parse a WebShop page's HTML (any text; malformed HTML is tolerated) into a `_Page`."""
    page = _Page()
    page.feed(html_text)
    page.close()
    return page


_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """("search" | "click", argument) for "search[...]" / "click[...]" (case-insensitive verb,
    whitespace flattened, cut to MAX_ACTION_CHARS); None for anything else or an empty argument."""
    flat = " ".join(str(action).split())[:MAX_ACTION_CHARS]
    m = _ACTION.match(flat)
    if m is None or not m.group(2).strip():
        return None
    return m.group(1).lower(), m.group(2).strip()


# --------------------------------------------------------------------------- the environment

def fetch(client: httpx.Client, method: str, url: str, data: dict[str, str] | None,
          timeout_s: float, max_bytes: int) -> tuple[int, httpx.URL, str]:
    """One request to the WebShop server -> (HTTP status, final URL after redirects, body text).

    GET sends `data` as query parameters, POST as a form. The body is streamed:
    reading it past `timeout_s` seconds since the request started (a server that
    drips bytes) or past `max_bytes` bytes raises WebShopError, as do connection
    errors and httpx's own per-read timeouts (the client's timeout).
    """
    start = time.monotonic()
    kwargs: dict[str, Any] = {"params": data} if method == "GET" else {"data": data}
    try:
        with client.stream(method, url, **kwargs) as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise WebShopError(f"WebShop page {method} {url} is {declared} bytes (max_page_bytes {max_bytes})")
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise WebShopError(f"WebShop page {method} {url} is over max_page_bytes ({max_bytes})")
                if time.monotonic() - start > timeout_s:
                    raise WebShopError(f"WebShop server timed out on {method} {url}: the page took over {timeout_s:g}s")
                chunks.append(chunk)
            text = b"".join(chunks).decode(resp.encoding or "utf-8", errors="replace")
            return resp.status_code, resp.url, text
    except httpx.TimeoutException as exc:
        raise WebShopError(f"WebShop server timed out on {method} {url}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise WebShopError(f"WebShop server unreachable on {method} {url}: {exc}") from exc


class WebShopEnv(ClosingEnv):
    """One episode on a WebShop server for goal `goal` (session "fixed_<goal>").

    base_url: the server (cfg.webshop.url). timeout_s: the deadline of one
    request (seconds, redirects and body included; see `fetch`).
    max_page_bytes: the largest page body accepted. Server failures (connection
    errors, timeouts, HTTP 4xx/5xx, an overlong page, a purchase page without a
    valid score) raise WebShopError and end the episode (step() then raises
    RuntimeError; reset() starts over).
    """

    def __init__(self, base_url: str, goal: int, max_observation_chars: int = 2000, timeout_s: float = 30.0,
                 max_page_bytes: int = MAX_PAGE_BYTES) -> None:
        self.base_url = base_url.rstrip("/")
        self.goal = int(goal)
        self.session = f"fixed_{self.goal}"
        self.max_observation_chars = max_observation_chars
        self.timeout_s, self.max_page_bytes = float(timeout_s), int(max_page_bytes)
        self._client: httpx.Client | None = httpx.Client(timeout=timeout_s, follow_redirects=True)
        self._page: _Page | None = None
        self._url = ""
        self._done = True  # until reset()
        self.state: dict[str, Any] = {}

    def _request(self, method: str, url: str, data: dict[str, str] | None = None) -> None:
        if self._client is None:
            raise RuntimeError("WebShopEnv is closed")
        target = urljoin(self._url or self.base_url + "/", url)
        self._done = True  # until the page arrives: a failed request ends the episode
        status, final_url, text = fetch(self._client, method, target, data, self.timeout_s, self.max_page_bytes)
        if status >= 400:
            raise WebShopError(f"WebShop server {self.base_url} answered HTTP {status} "
                               f"for {method} {target}: {text[:200]!r}")
        page = parse_page(text)
        if page.reward() is None and "/done/" in final_url.path:  # reward() raises on a malformed score
            raise WebShopError(f"WebShop server {self.base_url}: the purchase page {final_url} shows no #reward")
        self._url, self._page = str(final_url), page

    def _step(self, invalid: bool = False) -> EnvStep:
        page = self._page
        assert page is not None
        reward = page.reward()  # validated in [0, 1] by _Page.reward
        done = reward is not None
        r = reward if reward is not None else 0.0
        won = done and r >= 1.0 - 1e-9
        self._done = done
        path = urlsplit(self._url).path.strip("/")
        self.state["page"] = path.split("/")[0] if "/" in path else "search"
        admissible = [] if done else ([SEARCH_COMMAND] if page.search else []) + \
            [f"click[{c[0]}]" for c in page.clickables.values()]
        return EnvStep(
            observation=cap(" [SEP] ".join(page.texts), self.max_observation_chars),
            admissible_commands=admissible,
            won=won,
            lost=done and not won,
            done=done,
            score=r,
            reward=r,
            invalid_action=invalid,
            info={"url": urlsplit(self._url).path, **self.state},
        )

    @property
    def instruction(self) -> str:
        """The goal's instruction as the last page showed it ("" before reset())."""
        return self._page.instruction if self._page else ""

    def reset(self) -> EnvStep:
        """Open the goal's search page (GET /fixed_<goal>). Raises WebShopError on a server failure."""
        self._url = ""
        self.state = {"page": "search", "keywords": None, "page_num": None, "asin": None, "options": {}}
        self._request("GET", f"{self.base_url}/{self.session}")
        return self._step()

    def step(self, action: str) -> EnvStep:
        """Run one action ("search[...]" or "click[...]"; any other text is an invalid action).

        Raises RuntimeError before reset() or after the purchase, WebShopError on a server failure.
        """
        if self._done or self._page is None:
            raise RuntimeError("WebShopEnv.step called on a finished (or not yet reset) episode")
        parsed = parse_action(action)
        page = self._page
        if parsed is None:
            return self._step(invalid=True)
        verb, arg = parsed
        if verb == "search":
            if page.search is None:
                return self._step(invalid=True)
            method, form_action, field = page.search
            self._request("GET" if method == "GET" else "POST", form_action, {field: arg})
            self.state.update(keywords=arg.lower(), page_num=1, asin=None, options={})
            return self._step()
        hit = page.clickables.get(" ".join(arg.split()).lower())
        if hit is None:
            return self._step(invalid=True)
        name, method, url, kind, group = hit
        page_before = self.state["page"]
        self._request("POST" if method == "POST" else "GET", url)
        self._track(kind, name, group, page_before)
        return self._step()

    def _track(self, kind: str, name: str, group: str, page_before: str) -> None:
        """Update the client-side state (keywords, results page, asin, options) after a click."""
        low = name.lower()
        if kind == "product":
            self.state.update(asin=name.upper(), options={})
        elif kind == "option":
            self.state["options"] = {**self.state["options"], group: name}
        elif low == "back to search":
            self.state.update(keywords=None, page_num=None, asin=None, options={})
        elif page_before == "search_results" and low in ("next >", "< prev") and self.state["page_num"]:
            self.state["page_num"] += 1 if low == "next >" else -1
        elif page_before == "item_page" and low in ("< prev", "< back to results"):
            self.state.update(asin=None, options={})

    def close(self) -> None:
        """Close the HTTP client; safe to call twice."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._done = True


# --------------------------------------------------------------------------- the adapter interface

def _goal_indices(cfg: EnvSection, split: str) -> list[int]:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    ws = cfg.webshop
    if split == "train":
        goals, pool, field = ws.goals, cfg.game_pool, "goals"
    else:
        goals, pool, field = ws.eval_goals, cfg.eval_pool, "eval_goals"
    if len(goals) < pool:
        raise ValueError(f"env.webshop.{field} has {len(goals)} goal indices but the {split} pool needs {pool}")
    chosen = list(goals[:pool])
    overlap = set(ws.goals[:cfg.game_pool]) & set(ws.eval_goals[:cfg.eval_pool])
    if overlap:
        raise ValueError(f"train and eval WebShop goals overlap: {sorted(overlap)[:5]}")
    return chosen


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """The WebShop tasks of `split`: goal indices cfg.webshop.goals[:cfg.game_pool] ("train") or
    cfg.webshop.eval_goals[:cfg.eval_pool] ("eval"), in that order.

    Each goal's instruction is read from the server (GET /fixed_<i>) and sets
    Task.objective and Task.category (= skill_key, see `webshop_category`);
    task_id = "webshop-<i>"; gold_path = [] (WebShop's human demonstrations are
    not served). Raises ValueError for a bad split / pool / overlapping goals,
    RuntimeError when the server (cfg.webshop.url) is unreachable or fails.
    """
    indices = _goal_indices(cfg, split)
    url = cfg.webshop.url.rstrip("/")
    tasks: list[Task] = []
    with httpx.Client(timeout=cfg.webshop.timeout_s, follow_redirects=True) as client:
        for i in indices:
            try:
                status, _, text = fetch(client, "GET", f"{url}/fixed_{i}", None, cfg.webshop.timeout_s,
                                        cfg.webshop.max_page_bytes)
            except WebShopError as exc:
                raise RuntimeError(f"WebShop server at {cfg.webshop.url} (env.webshop.url) failed: {exc}. "
                                   f"Start it as described in {SETUP_DOC}.") from exc
            if status >= 400:
                raise RuntimeError(f"WebShop server at {cfg.webshop.url} answered HTTP {status} for goal {i} "
                                   f"(is the index within the server's goals?); see {SETUP_DOC}.")
            instruction = parse_page(text).instruction
            if not instruction:
                raise RuntimeError(f"{cfg.webshop.url}/fixed_{i} has no WebShop instruction (#instruction-text): "
                                   f"is env.webshop.url a WebShop server? See {SETUP_DOC}.")
            category = webshop_category(instruction)
            tasks.append(Task(task_id=f"webshop-{i}", category=category, spec={"goal": i}, skill_key=category,
                              gold_path=[], objective=instruction))
    return tasks


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> WebShopEnv:
    """A WebShopEnv on cfg.webshop.url for the task's goal (task.spec["goal"]); no request is made until reset().

    Raises ValueError when task.spec has no "goal" that is an integer >= 0.
    """
    goal = task.spec.get("goal") if isinstance(task.spec, dict) else None
    if isinstance(goal, str) and goal.strip().isdigit():
        goal = int(goal)
    if not isinstance(goal, int) or isinstance(goal, bool) or goal < 0:
        raise ValueError(f"WebShop task {task.task_id!r}: spec field 'goal' must be an integer >= 0 "
                         f"(the goal index), got {goal!r}")
    return WebShopEnv(cfg.webshop.url, goal, cfg.max_observation_chars, cfg.webshop.timeout_s,
                      cfg.webshop.max_page_bytes)
