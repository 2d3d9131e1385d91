// Conversations kept in the browser's localStorage (they never leave the browser except as the
// requests the user sends). The API key is kept only for the tab's session.

const KEY = "servelm.playground.conversations";
const KEY_CURRENT = "servelm.playground.current";
const KEY_SETTINGS = "servelm.playground.settings";
const KEY_API_KEY = "servelm.playground.apiKey";
const MAX_CONVERSATIONS = 50;

function read(storage, key, fallback) {
  try {
    const value = storage.getItem(key);
    return value === null ? fallback : JSON.parse(value);
  } catch {
    return fallback; // storage disabled or a value from an older page: start afresh
  }
}

function write(storage, key, value) {
  try {
    storage.setItem(key, JSON.stringify(value));
  } catch {
    // Full or disabled storage: the page still works, it just forgets.
  }
}

export class Conversations {
  constructor() {
    this.all = read(localStorage, KEY, []);
    this.currentId = read(localStorage, KEY_CURRENT, null);
    // An answer still streaming when the page went away was cut off there.
    for (const c of this.all) for (const m of c.messages || []) if (m.state === "streaming") m.state = "stopped";
    if (!this.current()) this.create();
  }

  current() {
    return this.all.find((c) => c.id === this.currentId) || null;
  }

  create() {
    const conversation = { id: `${Date.now()}-${Math.random().toString(36).slice(2, 8)}`, title: "New conversation", messages: [] };
    this.all.unshift(conversation);
    this.all.length = Math.min(this.all.length, MAX_CONVERSATIONS);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    this.save();
  }

  remove(id) {
    this.all = this.all.filter((c) => c.id !== id);
    if (this.currentId === id) {
      if (this.all.length) this.select(this.all[0].id);
      else this.create();
    }
    this.save();
  }

  save() {
    const c = this.current();
    if (c && c.messages.length && c.title === "New conversation") c.title = c.messages[0].content.slice(0, 40) || c.title;
    write(localStorage, KEY, this.all);
    write(localStorage, KEY_CURRENT, this.currentId);
  }
}

export const settingsStore = {
  load: () => read(localStorage, KEY_SETTINGS, {}),
  save: (settings) => write(localStorage, KEY_SETTINGS, settings),
};

export const apiKeyStore = {
  load: () => read(sessionStorage, KEY_API_KEY, ""),
  save: (key) => write(sessionStorage, KEY_API_KEY, key),
};
