"""A tiny stand-in for the WebShop web server, used only by tests/test_env_webshop.py.

This is NOT WebShop. It is a few-product imitation of princeton-nlp/WebShop's
Flask app (web_agent_site/app.py) written for these tests: it serves the same
routes and the same HTML shapes (ids, classes, forms, radio inputs with
`data-url`), so `opsd.envs.webshop` can be exercised end to end without the
real server, its 1.18M-product data and its search index.

Routes (GET and POST, as in the real app):
    /<session_id>                        search page; POST search_query=... redirects to the results
    /search_results/<sid>/<keywords>/<page>
    /item_page/<sid>/<asin>/<keywords>/<page>/<options>
    /item_sub_page/<sid>/<asin>/<keywords>/<page>/<sub_page>/<options>
    /done/<sid>/<asin>/<options>         the purchase: renders the reward

Session "fixed_<i>" selects goal i (an unknown index answers 500, as the real
app's IndexError does); any other session id gets goal 0 (the real app draws a
random goal). `keywords` is the Python repr of the keyword list and `options`
the repr of the chosen-options dict, URL-quoted, as Flask's url_for renders them.

The reward imitates WebShop's get_reward (web_agent_site/engine/goal.py):
(matched attributes + matched options + price ok) / (#attributes + #options + 1),
times a type factor from query / category / title-word overlap. Simplified:
no spaCy, no fuzzy matching (exact or substring matches only).
"""

from __future__ import annotations

import ast
import html
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

PRODUCTS: list[dict[str, Any]] = [
    {"asin": "B0STAND001", "Title": "Men's Canvas Running Shoes, Lightweight Breathable Sneakers", "price": 35.99,
     "options": {"color": ["black", "white", "navy blue"], "size": ["8", "9", "10", "11"]},
     "Attributes": ["lightweight", "breathable", "rubber sole"], "query": "men running shoes",
     "product_category": "Clothing, Shoes & Jewelry › Men › Shoes › Athletic",
     "Description": "Canvas upper and a cushioned insole for daily runs.",
     "BulletPoints": ["Lace-up closure", "Rubber sole"]},
    {"asin": "B0STAND002", "Title": "Women's Leather Ankle Boots with Block Heel", "price": 59.0,
     "options": {"color": ["brown", "black"], "size": ["6", "7", "8"]},
     "Attributes": ["leather", "block heel"], "query": "women ankle boots",
     "product_category": "Clothing, Shoes & Jewelry › Women › Shoes › Boots",
     "Description": "Genuine leather boots.", "BulletPoints": ["Side zipper"]},
    {"asin": "B0STAND003", "Title": "Wireless Bluetooth Headphones, Noise Cancelling Over-Ear", "price": 45.5,
     "options": {"color": ["black", "silver"]},
     "Attributes": ["wireless", "noise cancelling", "long battery life"], "query": "bluetooth headphones",
     "product_category": "Electronics › Headphones › Over-Ear",
     "Description": "Forty hours of playback on one charge.", "BulletPoints": ["Foldable", "Built-in microphone"]},
    {"asin": "B0STAND004", "Title": "USB-C Fast Charger 30W Wall Adapter", "price": 15.99, "options": {},
     "Attributes": ["fast charging", "compact"], "query": "usb c charger",
     "product_category": "Electronics › Accessories › Chargers",
     "Description": "Charges phones and tablets.", "BulletPoints": ["30W output"]},
    {"asin": "B0STAND005", "Title": "Organic Dark Chocolate Bar, Gluten Free, 12 Pack", "price": 24.0,
     "options": {"flavor": ["sea salt", "almond", "mint"]},
     "Attributes": ["organic", "gluten free"], "query": "dark chocolate",
     "product_category": "Grocery & Gourmet Food › Snacks › Chocolate",
     "Description": "Seventy percent cocoa. " * 400,  # a very long page: the observation cap test reads it
     "BulletPoints": ["Fair trade cocoa"]},
    {"asin": "B0STAND006", "Title": "Milk Chocolate Candy Assortment Gift Box", "price": 18.0, "options": {},
     "Attributes": ["gift box"], "query": "chocolate gift",
     "product_category": "Grocery & Gourmet Food › Candy › Assortments",
     "Description": "Twenty-four assorted pieces.", "BulletPoints": ["Gift wrapped"]},
    {"asin": "B0STAND007", "Title": "Matte Liquid Lipstick, Long Lasting Waterproof", "price": 9.99,
     "options": {"color": ["ruby red", "nude pink", "berry"]},
     "Attributes": ["long lasting", "waterproof", "matte"], "query": "liquid lipstick",
     "product_category": "Beauty & Personal Care › Makeup › Lips",
     "Description": "Stays on for twelve hours.", "BulletPoints": ["Cruelty free"]},
    {"asin": "B0STAND008", "Title": "Solid Wood Nightstand with Storage Drawer", "price": 79.0,
     "options": {"color": ["walnut", "white"]},
     "Attributes": ["solid wood", "storage drawer"], "query": "nightstand",
     "product_category": "Home & Kitchen › Furniture › Bedroom Furniture",
     "Description": "Pine wood, easy assembly.", "BulletPoints": ["One drawer"]},
]
BY_ASIN = {p["asin"]: p for p in PRODUCTS}

GOALS: list[dict[str, Any]] = [
    {"asin": "B0STAND001", "attributes": ["lightweight", "breathable"], "goal_options": {"color": "navy blue", "size": "10"},
     "price_upper": 50.0, "instruction_text": "i need lightweight breathable men's running shoes, "
     "color: navy blue, size: 10, and price lower than 50.00 dollars"},
    {"asin": "B0STAND003", "attributes": ["wireless", "noise cancelling"], "goal_options": {"color": "black"},
     "price_upper": 60.0, "instruction_text": "i want wireless noise cancelling bluetooth headphones, color: black, "
     "and price lower than 60.00 dollars"},
    {"asin": "B0STAND005", "attributes": ["organic", "gluten free"], "goal_options": {"flavor": "sea salt"},
     "price_upper": 30.0, "instruction_text": "i am looking for organic gluten free dark chocolate with sea salt "
     "flavor, and price lower than 30.00 dollars"},
    {"asin": "B0STAND007", "attributes": ["long lasting", "waterproof"], "goal_options": {"color": "ruby red"},
     "price_upper": 20.0, "instruction_text": "find me a long lasting waterproof lipstick, color: ruby red, "
     "and price lower than 20.00 dollars"},
    {"asin": "B0STAND008", "attributes": ["solid wood"], "goal_options": {"color": "walnut"},
     "price_upper": 100.0, "instruction_text": "i want a solid wood nightstand in walnut color, "
     "and price lower than 100.00 dollars"},
]
SUB_PAGES = ("Description", "Features", "Reviews", "Attributes")
_STOP = {"with", "and", "for", "the", "a", "of", "in", "s", "men", "women"}


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOP}


def reward(goal: dict[str, Any], product: dict[str, Any], options: dict[str, str]) -> float:
    """WebShop-like purchase reward in [0, 1] (see the module docstring); 1.0 for the exact product and options."""
    target = BY_ASIN[goal["asin"]]
    query_match = product["query"] == target["query"]
    cats = lambda p: {c.strip() for c in p["product_category"].split("›")}  # noqa: E731
    category_match = len(cats(product) & cats(target)) >= 2
    want = _words(target["Title"])
    title_score = len(want & _words(product["Title"])) / len(want)
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    text = " ".join([product["Title"], *product["BulletPoints"], product["Description"]]).lower()
    n_attr = sum(1 for a in goal["attributes"] if a in product["Attributes"] or a in text)
    goal_values = list(goal["goal_options"].values())
    n_opt = sum(1 for v in options.values() if v in goal_values or v in text)
    price_ok = product["price"] <= goal["price_upper"]
    total = (n_attr + n_opt + price_ok) / (len(goal["attributes"]) + len(goal_values) + 1)
    return round(total * r_type, 4)


# --------------------------------------------------------------------------- HTML, shaped like WebShop's templates

def _q(value: Any) -> str:
    return quote(str(value), safe="")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _page(body: str) -> str:
    return ("<!DOCTYPE html>\n<html>\n  <head>\n    <title>WebShop</title>\n"
            "    <script>var unused = 'scripts are not text';</script>\n  </head>\n  <body>\n" + body + "\n  </body>\n</html>")


def _instruction(goal: dict[str, Any], keywords: str | None = None) -> str:
    out = f'<div id="instruction-text"><h4>Instruction: {_e(goal["instruction_text"])}</h4>'
    if keywords is not None:
        out += f"<h4>Current Query: {_e(keywords)}</h4>"
    return out + "</div>"


def _button(action: str, label: str, cls: str = "btn btn-primary") -> str:
    return f'<form method="post" action="{action}"><button type="submit" class="{cls}">{_e(label)}</button></form>'


def search_page(sid: str, goal: dict[str, Any]) -> str:
    return _page(
        f'<div id="logo"><h2>WebShop</h2></div><div id="instruction-text" class="text-center">'
        f'<h4>Instruction: <br>{_e(goal["instruction_text"])}</h4></div>'
        f'<form role="form" id="form-buscar" method="post" action="/{_q(sid)}">'
        '<input id="search_input" class="form-control" type="text" name="search_query" placeholder="Search..." required/>'
        '<button class="btn btn-success" type="submit">Search</button></form>')


def results_page(sid: str, goal: dict[str, Any], keywords: list[str], page: int, page_size: int) -> str:
    query = _words(" ".join(keywords))
    scored = [(len(query & _words(" ".join([p["Title"], p["query"], *p["Attributes"]]))), p["asin"]) for p in PRODUCTS]
    hits = [BY_ASIN[a] for s, a in sorted(scored, key=lambda t: (-t[0], t[1])) if s > 0]
    shown = hits[(page - 1) * page_size: page * page_size]
    kw = _q(keywords)
    nav = _button(f"/{_q(sid)}", "Back to Search", "btn btn-success")
    if page > 1:
        nav += _button(f"/search_results/{_q(sid)}/{kw}/{page - 1}", "< Prev")
    if page * page_size < len(hits):
        nav += _button(f"/search_results/{_q(sid)}/{kw}/{page + 1}", "Next >")
    items = "".join(
        f'<div class="grid-item"><h4 class="product-asin"><a class="product-link" '
        f'href="/item_page/{_q(sid)}/{p["asin"]}/{kw}/{page}/{_q({})}">{p["asin"]}</a></h4>'
        f'<h4 class="product-title">{_e(p["Title"])}</h4><h5 class="product-price">${p["price"]}</h5></div>'
        for p in shown)
    return _page(_instruction(goal, " ".join(keywords)) + "<h1>Results</h1>"
                 f"<p>Page {page} ({(page - 1) * page_size + 1}-{page * page_size}) of {len(hits)} total results</p>"
                 + nav + f'<div class="grid-container">{items}</div>')


def item_page(sid: str, goal: dict[str, Any], asin: str, keywords: str, page: str, options: dict[str, str]) -> str:
    p = BY_ASIN[asin]
    kw, pre = _q(keywords), f"/{_q(sid)}"
    body = _instruction(goal, keywords) + _button(pre, "Back to Search", "btn btn-success")
    body += _button(f"/search_results/{_q(sid)}/{kw}/{page}", "< Prev")
    for name, values in p["options"].items():
        body += f"<div><h4>{_e(name)}</h4><div class=\"radio-toolbar\">"
        for i, value in enumerate(values):
            url = f"/item_page/{_q(sid)}/{asin}/{kw}/{page}/{_q({**options, name: value})}"
            body += (f'<input type="radio" id="radio_{_e(name)}{i}" name="{_e(name)}" value="{_e(value)}" data-url="{url}">'
                     f'<label for="radio_{_e(name)}{i}">{_e(value)}</label>')
        body += "</div></div>"
    body += f"<h2>{_e(p['Title'])}</h2><h4>Price: ${p['price']}</h4><h4>Rating: N.A.</h4>"
    for sub in SUB_PAGES[:3]:
        body += _button(f"/item_sub_page/{_q(sid)}/{asin}/{kw}/{page}/{sub}/{_q(options)}", sub)
    body += _button(f"/done/{_q(sid)}/{asin}/{_q(options)}", "Buy Now", "btn btn-lg purchase")
    return _page(body)


def sub_page(sid: str, goal: dict[str, Any], asin: str, keywords: str, page: str, sub: str, options: dict[str, str]) -> str:
    p = BY_ASIN[asin]
    content = {"Description": p["Description"], "Features": " ".join(p["BulletPoints"]),
               "Reviews": "No reviews yet.", "Attributes": ", ".join(p["Attributes"])}[sub]
    return _page(_instruction(goal, keywords) + _button(f"/{_q(sid)}", "Back to Search", "btn btn-success")
                 + _button(f"/item_page/{_q(sid)}/{asin}/{_q(keywords)}/{page}/{_q(options)}", "< Prev")
                 + f'<p class="product-info">{_e(content)}</p>')


def done_page(asin: str, options: dict[str, str], r: float) -> str:
    return _page('<div id="thankyou"><h1>Thank you for shopping with us!</h1></div><div id="stats">'
                 f'<div style="display:none"><h4 id="asin">asin<pre>{asin}</pre></p>'
                 f'<h4 id="options">options<pre>{_e(options)}</pre></h4></div>'
                 f'<h3 id="reward">Your score (min 0.0, max 1.0)<pre>{r}</pre></h3></div>')


# --------------------------------------------------------------------------- the server

class StandinWebShop:
    """The stand-in server on 127.0.0.1:<free port>, served from a daemon thread.

    `url` is its base URL. `fail_status`: when set (e.g. 500), every request
    answers that status (to test server errors mid-episode); `delay_s`: every
    answer waits that long first (to test timeouts). `page_size`:
    results per page (WebShop shows 10). Use as a context manager, or call
    start() and stop().
    """

    def __init__(self, page_size: int = 10) -> None:
        self.page_size = page_size
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.requests = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="webshop-standin", daemon=True)

    def start(self) -> "StandinWebShop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "StandinWebShop":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def route(self, method: str, path: str, form: dict[str, str]) -> tuple[int, str, str | None]:
        """(status, html, redirect location or None) for one request."""
        self.requests += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_status is not None:
            return self.fail_status, "stand-in failure", None
        seg = [unquote(s) for s in path.strip("/").split("/")]
        if len(seg) == 1 and seg[0]:
            sid = seg[0]
            goal = self._goal(sid)
            if goal is None:
                return 500, "Internal Server Error: no such goal", None
            if method == "POST" and form.get("search_query"):
                keywords = form["search_query"].lower().split(" ")
                return 302, "", f"/search_results/{_q(sid)}/{_q(keywords)}/1"
            return 200, search_page(sid, goal), None
        goal = self._goal(seg[1]) if len(seg) > 1 else None
        try:
            if seg[0] == "search_results" and len(seg) == 4 and goal:
                kw = ast.literal_eval(seg[2]) if seg[2].startswith("[") else [seg[2]]
                return 200, results_page(seg[1], goal, kw, int(seg[3]), self.page_size), None
            if seg[0] == "item_page" and len(seg) == 6 and goal:
                return 200, item_page(seg[1], goal, seg[2], seg[3], seg[4], ast.literal_eval(seg[5])), None
            if seg[0] == "item_sub_page" and len(seg) == 7 and goal and seg[5] in SUB_PAGES:
                return 200, sub_page(seg[1], goal, seg[2], seg[3], seg[4], seg[5], ast.literal_eval(seg[6])), None
            if seg[0] == "done" and len(seg) == 4 and goal:
                options = ast.literal_eval(seg[3])
                return 200, done_page(seg[2], options, reward(goal, BY_ASIN[seg[2]], options)), None
        except (KeyError, ValueError, SyntaxError) as exc:
            return 500, f"Internal Server Error: {exc!r}", None
        return 404, "Not Found", None

    @staticmethod
    def _goal(sid: str) -> dict[str, Any] | None:
        if "fixed" not in sid:
            return GOALS[0]
        try:
            return GOALS[int(sid.split("_")[-1])]
        except (ValueError, IndexError):
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        shop = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                form: dict[str, str] = {}
                if method == "POST":
                    n = int(self.headers.get("Content-Length") or 0)
                    form = {k: v[0] for k, v in parse_qs(self.rfile.read(n).decode("utf-8", "replace")).items()}
                status, body, location = shop.route(method, urlsplit(self.path).path, form)
                data = body.encode("utf-8")
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        return Handler
