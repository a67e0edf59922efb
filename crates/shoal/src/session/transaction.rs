//! Transaction mode's loop: the client's buffered messages served one transaction at a
//! time, each on a server checked out for it and given back at its boundary.

use super::*;

impl Session {
    /// The transaction-mode loop. Only the idle wait lives in this future: everything that
    /// runs while the client is active is boxed, so an idle client's task stays small.
    pub(super) async fn run_transaction_mode(&mut self) -> Result<Next, SessionError> {
        loop {
            // One allocation per burst of activity (not per message or transaction).
            match Box::pin(self.serve_buffered()).await? {
                Gone::Yes => return Ok(Next::Done),
                Gone::No => {
                    // Between transactions, an upgrade under way takes the client along
                    // (with any bytes of its next request already read).
                    if self.app.lifecycle.handoff.get().is_some()
                        && Box::pin(self.try_hand_over()).await
                    {
                        return Ok(Next::HandedOver);
                    }
                    if self.cbuf.is_empty() {
                        if matches!(self.stream, Stream::Link(_)) {
                            self.ship_state();
                            // This node is shutting down: the relaying node takes the client
                            // on to the pool's next owner, between its transactions.
                            if self.hand_back() {
                                return Ok(Next::HandedOver);
                            }
                        }
                        // Idle: hold no buffer, no server, no timer, no budget.
                        budget::release(&self.app.large_message_kib, &mut self.large_kib);
                        crate::bufpool::give(std::mem::take(&mut self.cbuf));
                        if let Some(e) = self.ended() {
                            return Err(e);
                        }
                        if matches!(self.stream, Stream::Tcp(_)) {
                            if let Some(target) = self.app.shards.placement(crate::shard::current())
                            {
                                return Ok(Next::MoveTo(target));
                            }
                        }
                    }
                    let read = if self.stream.is_buffered() {
                        relay::reserve_for_next(&mut self.cbuf, false);
                        std::future::poll_fn(|cx| self.poll_idle(cx, true))
                            .await?
                            .map(Some)
                    } else {
                        // Readiness first, holding no buffer; then one read that does not
                        // wait.
                        match std::future::poll_fn(|cx| self.poll_idle(cx, false)).await? {
                            Ok(_) => {
                                relay::reserve_for_next(&mut self.cbuf, false);
                                self.stream.read_now(&mut self.cbuf)
                            }
                            Err(e) => Err(e),
                        }
                    };
                    match read {
                        Ok(Some(0)) if self.ended().is_some() => {
                            // Shutdown or the end of our pool closed our read side: say
                            // why, as PostgreSQL does.
                            return Err(self.ended().unwrap_or_else(|| {
                                SessionError::fatal(
                                    ErrorKind::Shutdown,
                                    sqlstate::ADMIN_SHUTDOWN,
                                    "terminating connection",
                                )
                            }));
                        }
                        Ok(Some(0)) => return Ok(Next::Done),
                        // Data, or stale readiness: go on (a stale wakeup holds no buffer).
                        Ok(_) => {}
                        Err(e) => return Err(e.into()),
                    }
                    self.account_large(0, false)?;
                }
            }
        }
    }

    /// Serves every complete message buffered, running transactions as they come, until
    /// more bytes are needed or the client is gone.
    async fn serve_buffered(&mut self) -> Result<Gone, SessionError> {
        loop {
            match self.handle_idle_messages().await? {
                Idle::NeedServer => {
                    let limits = Plugged::limits(&self.pool);
                    if let Some(l) = &limits {
                        if let Err(r) = Plugged::admit_unit(l).await {
                            self.refuse_over_limit(r).await?;
                            continue;
                        }
                    }
                    // Asked only where there is a cache: most pools make no future for it.
                    if Plugged::has_cache(&self.pool) && self.answer_from_cache().await? {
                        continue;
                    }
                    let admitted = match &limits {
                        Some(l) => Plugged::admit_transaction(l).await.map(Some),
                        None => Ok(None),
                    };
                    let running = match admitted {
                        Ok(r) => r,
                        Err(r) => {
                            if let Some(x) = self.extras.as_mut() {
                                x.capture = None;
                            }
                            self.refuse_over_limit(r).await?;
                            continue;
                        }
                    };
                    let gone = self.run_transaction().await?;
                    drop(running);
                    if gone {
                        return Ok(Gone::Yes);
                    }
                }
                Idle::NeedMore => return Ok(Gone::No),
                Idle::Terminate => return Ok(Gone::Yes),
            }
        }
    }

    /// Serves the buffered messages that need a server: checkout, relay to the transaction
    /// boundary, checkin. Returns true when the client is gone.
    async fn run_transaction(&mut self) -> Result<bool, SessionError> {
        if self.extras.as_ref().is_some_and(|x| x.owns_servers)
            && self.pool.state_lost(self.id)
            && self.extras.as_ref().is_some_and(|x| x.keeps_state)
        {
            // Never silence: the statement would run without the state it may rely on.
            // (A client whose only state is SETs Shoal replays lost nothing.) What lasted is
            // gone now: told once.
            if let Some(x) = self.extras.as_mut() {
                x.keeps_state = false;
            }
            self.fail_unit(sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE, STATE_LOST)
                .await?;
            return Ok(false);
        }
        if let Some(r) = Plugged::rules(&self.pool) {
            // Until the catalogue is read, a function rule cannot see behind operators,
            // casts and views: the first transactions wait for it.
            Plugged::rules_ready(&r, self.pool.settings.connect_timeout).await;
        }
        self.cancel.slot.mark_busy();
        if let Some(sub) = self.extras.as_ref().and_then(|x| x.listen.as_ref()) {
            // Its notifications now wait for the transaction's end.
            Plugged::mailbox(sub).busy();
        }
        let attached = self.attach().await;
        // A fill runs only on the server just found (see `cached`).
        let capture = self.extras.as_mut().and_then(|x| x.capture.take());
        let Some((mut lease, proven)) = attached? else {
            self.cancel.slot.not_busy();
            return Ok(false);
        };
        if !self.cancel.slot.set(lease.cancel_target()) {
            // Cancelled while its server was being found: the request never reaches it, as
            // when the cancel comes during the wait for a server.
            lease.checkin();
            self.fail_unit(
                sqlstate::QUERY_CANCELED,
                "canceling statement due to user request",
            )
            .await?;
            return Ok(false);
        }
        self.set_active(true);
        let mut flow = Flow::default();
        let end = self
            .relay(&mut lease, &mut flow, Policy::Transaction, proven, capture)
            .await;
        self.end_claim(lease.process_id);
        if !self.cancel.slot.clear_now() {
            // A cancel on its way (rare): boxed, so the session's future stays its size.
            Box::pin(self.cancel.slot.clear()).await;
        }
        self.set_active(false);
        match end {
            Ok(RelayEnd::Boundary) => {
                lease.session.transaction_ended(self.id);
                if lease.session.fit(self.id) == crate::server_session::Fit::Own {
                    // Told when it leaves (its servers become nobody's) or when a full
                    // pool takes its server (see `run_transaction`).
                    Extras::get(&mut self.extras).owns_servers = true;
                }
                if lease.session.take_listens() {
                    match Box::pin(self.unlisten(lease)).await {
                        Some(back) => lease = back,
                        None => return Ok(false),
                    }
                }
                self.give_back(lease);
                Ok(false)
            }
            Ok(RelayEnd::Terminate) => {
                lease.release(leaving(&flow, false)).await;
                Ok(true)
            }
            Ok(RelayEnd::ClientGone) => {
                lease.release(leaving(&flow, false)).await;
                self.gone_or_shut_down().map(|()| true)
            }
            Ok(RelayEnd::ServerLost(fatal)) => {
                drop(lease);
                if flow.status != b'I' {
                    return Err(self.lost_in_block(fatal));
                }
                self.report_server_loss(&flow, fatal).await?;
                Ok(false)
            }
            Err(e) => {
                lease.release(leaving(&flow, false)).await;
                Err(e)
            }
        }
    }

    /// The server goes back to the pool after its transaction ended, unless bytes nobody
    /// asked for, or replies still owed, say it is not at a true boundary: then no other
    /// client may have it, and it is closed.
    fn give_back(&self, lease: Lease) {
        let unread = !(lease.buf.is_empty() && lease.session.owes_nothing());
        if unread {
            tracing::warn!(conn = self.id, pool = %self.pool.name, unread = lease.buf.len(), owed = lease.session.owed(), "server not at a clean boundary; closing it");
        }
        let state = crate::disposition::ServerState {
            unread,
            ..Default::default()
        };
        match crate::disposition::decide(&state) {
            crate::disposition::Disposition::Close(reason) => lease.close(reason),
            _ => lease.checkin(),
        }
    }

    /// Stops a server that ran the client's LISTEN from listening before it goes back to
    /// the pool (what it received meanwhile is dropped: the pool's listener delivers it).
    /// `None` when the server failed and was closed.
    async fn unlisten(&self, mut lease: Lease) -> Option<Lease> {
        let limit = self.pool.settings.reset_timeout;
        match crate::timer::timeout(limit, lease.simple_query("UNLISTEN *")).await {
            Ok(Ok(())) => Some(lease),
            _ => {
                tracing::warn!(conn = self.id, pool = %self.pool.name, "could not unlisten a server; closing it");
                lease.close(crate::disposition::CloseReason::Lost);
                None
            }
        }
    }

    /// A server ready for this client's next transaction: checked out (a cancel from the
    /// client ends a wait, as it would end the query on a direct connection) and prepared.
    /// A server that fails before anything of the client's reached it is replaced once.
    /// `None` when the failure was reported to the client instead.
    /// With the lease, how many messages at the head of the client's buffer were proven to
    /// read (for a replica's server; see [`reads`]).
    async fn attach(&mut self) -> Result<Option<(Lease, u32)>, SessionError> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            // Another pool than the client's when a replica reads, or a promoted one writes.
            let (other, replica) = match Plugged::replicas(&self.pool) {
                None => (None, None),
                Some(_) => match Box::pin(self.next_backend()).await? {
                    Some(b) => b,
                    None => return Ok(None),
                },
            };
            let pool = other.as_ref().unwrap_or(&self.pool);
            let sets = self.extras.as_ref().map(|x| &x.sets);
            let r = pool
                .prepared_server(self.id, &self.params, sets, &*self.cancel.slot)
                .await;
            let e = match r {
                Ok(lease) => return Ok(Some((lease, replica.unwrap_or(0)))),
                Err(e) => ClientError::wait(&pool.name, &e),
            };
            if let Some(failed) = other.as_ref().filter(|_| replica.is_some()) {
                if e.kind == crate::error::ErrorKind::ServerUnavailable && attempts <= 3 {
                    // A replica that cannot be reached gets no traffic for a while; the
                    // unit goes to another backend (nothing of it reached this one).
                    self.ban_replica(failed);
                    tracing::warn!(conn = self.id, pool = %failed.name, detail = %Escaped(&e.detail), "replica unavailable; trying another backend");
                    continue;
                }
            }
            if e.kind == crate::error::ErrorKind::Canceled {
                self.fail_unit(e.code, &e.message).await?;
                return Ok(None);
            }
            if e.kind == crate::error::ErrorKind::Fenced {
                // Another node serves the pool now (cluster): on this connection the client
                // would be refused for good; a new one is relayed to the owner.
                tracing::warn!(conn = self.id, pool = %self.pool.name, "the pool is no longer served by this node: closing the client so that it reconnects");
                return Err(SessionError::fatal(
                    e.kind,
                    e.code,
                    format!("{}; the statement did not run", e.message),
                ));
            }
            tracing::warn!(conn = self.id, pool = %self.pool.name, kind = e.kind.label(), detail = %Escaped(&e.detail), retry = e.retry_safe && attempts < 2, "no server for the client");
            if !(e.retry_safe && attempts < 2) {
                self.fail_unit(e.code, &e.message).await?;
                return Ok(None);
            }
        }
    }
}
