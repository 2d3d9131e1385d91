// A small markdown renderer that builds DOM nodes and puts every piece of model output in as text
// (createTextNode), never as HTML: an answer containing <script> or <img onerror> shows as text.
// It knows fenced code blocks, headings, bullet and numbered lists, paragraphs, inline code, bold
// and italics; anything else stays plain text.

const FENCE = /^\s*(```|~~~)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d+)[.)]\s+(.*)$/;
// Inline spans, earliest first: `code`, **bold** / __bold__, *italic* / _italic_.
const INLINE = /(`+)([\s\S]+?)\1|\*\*([\s\S]+?)\*\*|__([\s\S]+?)__|\*(?!\s)([\s\S]+?)\*|\b_(?!\s)([\s\S]+?)_\b/;

function el(tag, children) {
  const node = document.createElement(tag);
  for (const child of children) node.append(child);
  return node;
}

// Inline markup as a list of nodes; text outside the spans goes in as text nodes.
export function renderInline(text) {
  const out = [];
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      out.push(document.createTextNode(rest));
      break;
    }
    if (m.index > 0) out.push(document.createTextNode(rest.slice(0, m.index)));
    if (m[1]) out.push(el("code", [document.createTextNode(m[2])]));
    else if (m[3] !== undefined || m[4] !== undefined) out.push(el("strong", renderInline(m[3] ?? m[4])));
    else out.push(el("em", renderInline(m[5] ?? m[6])));
    rest = rest.slice(m.index + m[0].length);
  }
  return out;
}

// The whole answer as a DocumentFragment of block elements.
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flushPara = () => {
    if (para.length) frag.append(el("p", renderInline(para.join("\n"))));
    para = [];
  };
  const flushList = () => {
    if (list) frag.append(list);
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushPara();
      flushList();
      const body = [];
      // An unclosed fence (an answer still streaming) runs to the end of the text.
      while (++i < lines.length && !lines[i].trimStart().startsWith(fence[1])) body.push(lines[i]);
      const code = el("code", [document.createTextNode(body.join("\n"))]);
      const lang = line.trim().slice(3).trim();
      if (lang) code.dataset.lang = lang;
      frag.append(el("pre", [code]));
      continue;
    }
    const heading = HEADING.exec(line);
    const bullet = BULLET.exec(line);
    const numbered = bullet ? null : NUMBERED.exec(line);
    if (heading) {
      flushPara();
      flushList();
      // Headings inside an answer rank below the page's own.
      frag.append(el(`h${Math.min(6, heading[1].length + 2)}`, renderInline(heading[2])));
    } else if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tagName.toLowerCase() !== tag) flushList();
      if (!list) {
        list = document.createElement(tag);
        if (numbered && numbered[1] !== "1") list.start = Number(numbered[1]);
      }
      list.append(el("li", renderInline(bullet ? bullet[1] : numbered[2])));
    } else if (!line.trim()) {
      flushPara();
      // Items apart by blank lines are still one list (models often write them so).
      const next = lines.slice(i + 1).find((l) => l.trim());
      if (!(list && next && (list.tagName === "UL" ? BULLET : NUMBERED).test(next))) flushList();
    } else {
      flushList();
      para.push(line);
    }
  }
  flushPara();
  flushList();
  return frag;
}
