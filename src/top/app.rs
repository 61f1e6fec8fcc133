//! The view's state and what each key does to it, as people know the
//! keys from bottom, nvitop and htop: `q`/Esc, `?`, ↑↓ and j/k, Tab,
//! Enter, `t`, `s`/`S`, `/`, `f`, `u`. No terminal here: a key in, the
//! state changed, so each key is a unit test.

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::widgets::TableState;

use super::model::{Filter, Model, Row, ViewOpts};

/// Where ↑↓ and Enter act; Tab moves between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pane {
    Procs,
    Queue,
    Gpus,
}

impl Pane {
    fn next(self) -> Pane {
        match self {
            Pane::Procs => Pane::Queue,
            Pane::Queue => Pane::Gpus,
            Pane::Gpus => Pane::Procs,
        }
    }

    fn prev(self) -> Pane {
        self.next().next()
    }
}

/// What Enter opened: the thing it names stays open across refreshes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Detail {
    /// A process on a GPU (by UUID).
    Proc {
        gpu: String,
        pid: u32,
    },
    /// A user's part of a GPU (`job` None) or one of its jobs.
    Share {
        gpu: String,
        uid: u32,
        job: Option<Option<u32>>,
    },
    /// A queued request, by its run's pid.
    Queued {
        pid: u32,
    },
    Gpu {
        uuid: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Popup {
    Help,
    Detail(Detail),
    /// `/`: the filter being typed.
    Filter(String),
}

pub struct App {
    pub opts: ViewOpts,
    pub pane: Pane,
    /// `f`: the view stops changing (top keeps fetching).
    pub frozen: bool,
    pub popup: Option<Popup>,
    pub procs: TableState,
    pub queue: TableState,
    pub gpus: TableState,
    pub quit: bool,
    /// Said in the last line until the next key: a filter that does not
    /// parse, a broker that does not answer.
    pub message: Option<String>,
}

impl App {
    pub fn new(opts: ViewOpts) -> App {
        App {
            opts,
            pane: Pane::Procs,
            frozen: false,
            popup: None,
            procs: TableState::default(),
            queue: TableState::default(),
            gpus: TableState::default(),
            quit: false,
            message: None,
        }
    }

    /// What `key` does, given what is shown.
    pub fn key(&mut self, key: KeyEvent, model: &Model) {
        if let Some(Popup::Filter(text)) = &mut self.popup {
            match key.code {
                KeyCode::Enter => {
                    let text = text.clone();
                    match Filter::parse(&text) {
                        Ok(f) => {
                            self.opts.filter = f;
                            self.popup = None;
                            self.message = None;
                            self.procs.select(Some(0));
                            self.queue.select(Some(0));
                        }
                        Err(e) => self.message = Some(e),
                    }
                }
                KeyCode::Esc => {
                    self.popup = None;
                    self.message = None;
                }
                KeyCode::Backspace => {
                    text.pop();
                }
                KeyCode::Char('u') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                    text.clear();
                }
                KeyCode::Char(c) if text.chars().count() < 200 => text.push(c),
                _ => {}
            }
            return;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            self.quit = true;
            return;
        }
        self.message = None;
        match key.code {
            KeyCode::Char('q') => self.quit = true,
            KeyCode::Esc if self.popup.is_some() => self.popup = None,
            KeyCode::Esc => self.quit = true,
            KeyCode::Char('?') | KeyCode::F(1) => {
                self.popup = match self.popup {
                    Some(Popup::Help) => None,
                    _ => Some(Popup::Help),
                }
            }
            // A detail or help open: other keys leave it first.
            _ if self.popup.is_some() && key.code != KeyCode::Enter => {
                self.popup = None;
                self.key(key, model);
            }
            KeyCode::Enter if self.popup.is_some() => self.popup = None,
            KeyCode::Tab => self.pane = self.pane.next(),
            KeyCode::BackTab => self.pane = self.pane.prev(),
            KeyCode::Down | KeyCode::Char('j') => self.step(model, 1),
            KeyCode::Up | KeyCode::Char('k') => self.step(model, -1),
            KeyCode::PageDown => self.step(model, 10),
            KeyCode::PageUp => self.step(model, -10),
            KeyCode::Home | KeyCode::Char('g') => self.step(model, isize::MIN / 2),
            KeyCode::End | KeyCode::Char('G') => self.step(model, isize::MAX / 2),
            KeyCode::Enter => self.popup = self.detail(model).map(Popup::Detail),
            KeyCode::Char('t') => {
                self.opts.tree = !self.opts.tree;
                self.procs.select(Some(0));
            }
            KeyCode::Char('s') => self.opts.sort = self.opts.sort.next(),
            KeyCode::Char('S') => self.opts.reverse = !self.opts.reverse,
            KeyCode::Char('/') => self.popup = Some(Popup::Filter(self.opts.filter.text().into())),
            KeyCode::Char('f') => self.frozen = !self.frozen,
            KeyCode::Char('u') => {
                self.opts.mine = !self.opts.mine;
                self.procs.select(Some(0));
                self.queue.select(Some(0));
            }
            _ => {}
        }
    }

    fn len(&self, model: &Model) -> usize {
        match self.pane {
            Pane::Procs => model.rows(&self.opts).len(),
            Pane::Queue => model.queue_rows(&self.opts).len(),
            Pane::Gpus => model.status.gpus.len(),
        }
    }

    fn state(&mut self) -> &mut TableState {
        match self.pane {
            Pane::Procs => &mut self.procs,
            Pane::Queue => &mut self.queue,
            Pane::Gpus => &mut self.gpus,
        }
    }

    /// Moves the focused pane's selection by `by` rows, within its rows.
    fn step(&mut self, model: &Model, by: isize) {
        let len = self.len(model);
        let st = self.state();
        if len == 0 {
            st.select(None);
            return;
        }
        let at = st.selected().unwrap_or(0).min(len - 1) as isize;
        let to = at.saturating_add(by).clamp(0, len as isize - 1) as usize;
        st.select(Some(to));
    }

    /// The selected row of the focused pane, within what is shown now.
    pub fn selected(&self, len: usize, pane: Pane) -> Option<usize> {
        let st = match pane {
            Pane::Procs => &self.procs,
            Pane::Queue => &self.queue,
            Pane::Gpus => &self.gpus,
        };
        (len > 0).then(|| st.selected().unwrap_or(0).min(len - 1))
    }

    /// What Enter opens on the focused pane's selected row.
    fn detail(&self, model: &Model) -> Option<Detail> {
        let gpus = &model.status.gpus;
        match self.pane {
            Pane::Procs => {
                let rows = model.rows(&self.opts);
                let row = rows[self.selected(rows.len(), Pane::Procs)?];
                Some(match row {
                    Row::Gpu { gpu } => Detail::Gpu {
                        uuid: gpus[gpu].uuid.clone(),
                    },
                    Row::User { gpu, user } => Detail::Share {
                        gpu: gpus[gpu].uuid.clone(),
                        uid: gpus[gpu].users[user].uid,
                        job: None,
                    },
                    Row::Job { gpu, user, job } => Detail::Share {
                        gpu: gpus[gpu].uuid.clone(),
                        uid: gpus[gpu].users[user].uid,
                        job: Some(gpus[gpu].users[user].jobs[job].job),
                    },
                    Row::Proc { gpu, proc, .. } => Detail::Proc {
                        gpu: gpus[gpu].uuid.clone(),
                        pid: gpus[gpu].processes[proc].pid,
                    },
                    // Only the driver knows it: its GPU says what it knows.
                    Row::Other { gpu, .. } => Detail::Gpu {
                        uuid: gpus[gpu].uuid.clone(),
                    },
                })
            }
            Pane::Queue => {
                let rows = model.queue_rows(&self.opts);
                let i = rows[self.selected(rows.len(), Pane::Queue)?];
                Some(Detail::Queued {
                    pid: model.status.queue[i].pid,
                })
            }
            Pane::Gpus => {
                let i = self.selected(gpus.len(), Pane::Gpus)?;
                Some(Detail::Gpu {
                    uuid: gpus[i].uuid.clone(),
                })
            }
        }
    }
}
